"""Empty-latent node: a LATENT of any size in Qwen-Image-2.1's layout, for KSampler's text-to-image at a size Qwen21
Encode does not derive (its own latent is square without condition images, or the last image's aspect)."""

from __future__ import annotations

import torch

from ..qwen21_core.config import TransformerConfig
from ..qwen21_core.images import MAX_SIDE, SIZE_MULTIPLE, check_output_size
from ..qwen21_core.request import LATENT_SCALE, MAX_BATCH
from . import host

# The DiT's input channels (16 VAE channels in 2x2 groups): the same for every Qwen-Image-2.1 checkpoint, so the
# node needs no model input.
LATENT_CHANNELS = TransformerConfig.in_channels


class Qwen21EmptyLatent:
    """An empty LATENT for KSampler (or SamplerCustomAdvanced) on a Qwen21 MODEL: width x height pixels, multiples of
    32. ComfyUI's Empty Latent Image works on that MODEL too (its latent is resized to ours, multiples of 16)."""

    CATEGORY = "Qwen21"
    DESCRIPTION = __doc__
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    OUTPUT_TOOLTIPS = ("Zeros [batch, 64, height / 16, width / 16]: KSampler's latent_image at denoise 1.",)
    FUNCTION = "make"

    @classmethod
    def INPUT_TYPES(cls):
        side = {"min": SIZE_MULTIPLE, "max": MAX_SIDE, "step": SIZE_MULTIPLE}
        return {
            "required": {
                "width": ("INT", {"default": 1024, **side, "tooltip": "Output width in pixels (a multiple of 32). "
                                  "Time per step grows with pixels."}),  # fmt: skip
                "height": ("INT", {"default": 1024, **side, "tooltip": "Output height in pixels (a multiple of 32)."}),
                "batch_size": ("INT", {"default": 1, "min": 1, "max": MAX_BATCH,
                                       "tooltip": "Images per run; the prefix is computed once for all."}),  # fmt: skip
            }
        }

    def make(self, width, height, batch_size=1):
        check_output_size(width, height)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size must be from 1 to {MAX_BATCH}, got {batch_size!r:.40}")
        shape = (batch_size, LATENT_CHANNELS, height // LATENT_SCALE, width // LATENT_SCALE)
        return ({"samples": torch.zeros(shape, device=host.intermediate_device())},)
