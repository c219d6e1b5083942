"""Prompt + condition-image encoder node -> QWEN21_CONDITIONING and the derived output size."""

from __future__ import annotations

import torch

from ..qwen21_core.encoding import check_prompt_length
from ..qwen21_core.images import MAX_SIDE, SIZE_MULTIPLE, masks_at_image_size
from ..qwen21_core.request import LATENT_SCALE
from . import host
from .comfy.conditioning import conditioning_entries
from .model import CONDITIONING_TYPE, MODEL_TYPE

# As many as native ComfyUI's TextEncodeQwenImage21 offers (the model's documentation describes up to 4; more
# work, with unmeasured quality). The web extension shows one more socket at a time.
MAX_IMAGES = 16


def _image_inputs() -> dict:
    inputs = {}
    for i in range(1, MAX_IMAGES + 1):
        inputs[f"image_{i}"] = (
            "IMAGE",
            {
                "tooltip": f"Condition image {i} (optional). Every image adds about (its pixels / 256) tokens to the "
                "prefix: a 1024x1024 reference adds 4096. The prefix is computed once and cached: at 1024x1024 "
                "a later step costs 133.5 ms with 1 reference, 181.7 ms with 4, against 114.4 ms without "
                "(BENCHMARKS: DiT). The model's documentation describes up to 4 images; more work, but their "
                "quality is not measured.",
            },
        )
        inputs[f"mask_{i}"] = (
            "MASK",
            {
                "tooltip": f"Alpha of image {i} as a ComfyUI MASK (1 - alpha, as LoadImage gives it); optional. It "
                f"must have image {i}'s size (a mask of another size is refused, not stretched), except a mask of "
                "one value, such as LoadImage's 64x64 one for an image without alpha, which fills the image."
            },
        )
    return inputs


def _condition_images(kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The connected image_i in order (gaps closed; a batch counts as that many images) and their masks."""
    # ComfyUI passes linked inputs the node does not declare (an API client's image_17) instead of dropping them.
    unknown = sorted(set(kwargs) - set(_image_inputs()))
    if unknown:
        raise ValueError(
            f"Qwen21Encode has no input {', '.join(unknown)}: it takes at most {MAX_IMAGES} condition images, "
            f"image_1..image_{MAX_IMAGES} with mask_1..mask_{MAX_IMAGES}"
        )
    images, masks = [], []
    for i in range(1, MAX_IMAGES + 1):
        image, mask = kwargs.get(f"image_{i}"), kwargs.get(f"mask_{i}")
        if image is None:
            if mask is not None:
                raise ValueError(f"mask_{i} is connected but image_{i} is not; connect the image the mask belongs to")
            continue
        if mask is not None and isinstance(image, torch.Tensor) and image.dim() == 4:  # before any work
            mask = torch.as_tensor(mask)
            masks_at_image_size(mask[None] if mask.dim() == 2 else mask, *image.shape[1:3], f"mask_{i}", f"image_{i}")
        images.append(image)
        masks.append(mask)
    return images, masks


class Qwen21Encode:
    """Encode the prompt with up to 16 condition images for Qwen-Image-2.1 (the negative prompt is encoded
    later, by the sampler, only when true_cfg_scale > 1 needs it).

    Outputs the conditioning and the output size derived from it (the last image's aspect ratio at
    `output_resolution`^2 pixels, or a square without images), rounded to multiples of 32.
    """

    CATEGORY = "Qwen21"
    DESCRIPTION = __doc__
    RETURN_TYPES = (CONDITIONING_TYPE, "INT", "INT", "CONDITIONING", "CONDITIONING", "LATENT")
    RETURN_NAMES = ("conditioning", "width", "height", "positive", "negative", "latent")
    OUTPUT_TOOLTIPS = (
        "Prompt embeddings and condition latents for the Qwen21 sampler.",
        "Output width derived from the inputs (pixels).",
        "Output height derived from the inputs (pixels).",
        "The prompt with its condition images as a ComfyUI CONDITIONING (native Qwen-Image-2.1's layout): for "
        "KSampler with the loader's MODEL; ComfyUI's conditioning nodes work on it.",
        "The negative prompt as a CONDITIONING. It is encoded only when a sampler's cfg is above 1 (at cfg 1 it "
        "costs nothing); an empty negative prompt is encoded as one space, as the reference does.",
        "An empty LATENT of the derived size, for KSampler's latent_image.",
    )
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "From a Qwen21 loader."}),
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "What to draw or how to edit."}),
                "negative_prompt": (
                    "STRING",
                    {
                        "multiline": True,
                        "default": "",
                        "tooltip": "Used only when the sampler's true_cfg_scale > 1, which doubles the cost of "
                        "every step. It is encoded then, by the sampler (once per conditioning), not here: at "
                        "cfg 1 it costs nothing. Leave empty for the usual cfg 1.",
                    },
                ),
                "output_resolution": (
                    "INT",
                    {
                        "default": 1024,
                        "min": SIZE_MULTIPLE,  # what the core takes, so the widget and its error say the same
                        "max": MAX_SIDE,
                        "step": SIZE_MULTIPLE,
                        "tooltip": "Side of the square with the output's pixel count. Cost grows with pixels: "
                        "2048 has 4x the tokens of 1024, and a step takes 634.1 ms instead of 114.4 ms on an "
                        "H200 (BENCHMARKS: DiT).",
                    },
                ),
            },
            "optional": _image_inputs(),
        }

    def encode(self, model, prompt, negative_prompt, output_resolution, **images):
        condition_images, masks = _condition_images(images)
        # a prompt too long for the DiT fails here, from the tokenizer, before any weights move
        sizes = [(image.shape[2], image.shape[1]) for image in condition_images for _ in range(image.shape[0])]
        check_prompt_length(model.pipe.text_encoder, prompt, sizes, output_resolution)
        cond = model.encode(
            prompt=prompt,
            images=condition_images,
            masks=masks if any(m is not None for m in masks) else None,
            negative_prompt=negative_prompt or None,  # pending: encoded only if a sampler's guidance uses it
            output_resolution=output_resolution,
        )
        device = host.intermediate_device()
        positive, negative = conditioning_entries(model, cond, device)
        channels = model.pipe.transformer.config.in_channels
        shape = (1, channels, cond.height // LATENT_SCALE, cond.width // LATENT_SCALE)
        empty = {"samples": torch.zeros(shape, device=device)}
        return (cond, cond.width, cond.height, positive, negative, empty)
