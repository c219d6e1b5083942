"""Our latent space as ComfyUI sees it, and ComfyUI's own empty latents sized for it.

`Qwen21LatentFormat`: raw [B, 64, H/16, W/16] latents travel between nodes (as native Qwen-Image-2.1's do); sampling
runs on them normalised with the loaded VAE's latents_mean / latents_std; live previews project them to RGB with
factors fitted from the VAE on first use.

Empty latents: Empty Latent Image, EmptySD3LatentImage and their kind make zeros at 1/8 of the pixel size (4 or 16
channels), and the samplers widen the channels to the model's (comfy/sample.py fix_empty_latent_channels). Our latent
is 1/16: taken as it is, such a latent gives an image twice the side asked for. ComfyUI 0.37 and later (native 2.1)
carry the node's scale in the LATENT (`downscale_ratio_spacial`) and resize an empty latent to the model's scale,
rounding. `size_empty_latents` wraps that function once so that, for our MODEL only: on an older ComfyUI (0.3.64),
which has no such key, an empty latent of another model's channels is taken as 1/8 and resized the same way; on any
ComfyUI a size that 16-pixel steps cannot give is refused by name instead of rounded. Other models' latents pass
through untouched.
"""

from __future__ import annotations

import functools
import inspect

import comfy.latent_formats
import comfy.sample
import torch

from ...qwen21_core.errors import stable_name
from ...qwen21_core.request import LATENT_SCALE

OLDER_EMPTY_LATENT_SCALE = 8  # pixels per latent side of every empty-latent node for image models before 0.37


@stable_name
class EmptyLatentSizeError(ValueError):
    """An empty latent whose image size Qwen-Image-2.1 cannot make (not a multiple of 16 pixels)."""


class Qwen21LatentFormat(comfy.latent_formats.LatentFormat):
    """The loaded VAE's latent space: raw [B, 64, H/16, W/16] latents travel between nodes (as native 2.1's do);
    sampling runs on them normalised with the VAE's latents_mean / latents_std."""

    latent_channels = 64
    latent_dimensions = 2
    spacial_downscale_ratio = 16

    def __init__(self, mean, std, fit_rgb):
        self.latents_mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.latents_std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self._fit_rgb = fit_rgb  # () -> (factors [64, 3], bias [3]) for raw latents
        self._rgb = None

    def _check(self, latent):
        if latent.dim() != 4 or latent.shape[1] != self.latent_channels:
            raise ValueError(f"Qwen21 MODEL: the LATENT is {list(latent.shape)}; Qwen-Image-2.1 latents are [B, "
                             f"{self.latent_channels}, H/16, W/16] (Qwen21 Encode's latent output, Qwen21 VAE Encode, "
                             "or VAE Encode with the Qwen21 VAE)")  # fmt: skip
        return latent

    def process_in(self, latent):
        return (self._check(latent) - self.latents_mean.to(latent)) / self.latents_std.to(latent)

    def process_out(self, latent):
        return self._check(latent) * self.latents_std.to(latent) + self.latents_mean.to(latent)

    def _normalised_rgb(self):
        """The previewer's factors for normalised latents: raw = z * std + mean folded into the fitted projection."""
        if self._rgb is None:
            factors, bias = self._fit_rgb()
            std, mean = self.latents_std.view(-1, 1), self.latents_mean.view(1, -1)
            self._rgb = ((factors * std).tolist(), (mean @ factors + bias).view(-1).tolist())
        return self._rgb

    @property
    def latent_rgb_factors(self):
        return self._normalised_rgb()[0]

    @property
    def latent_rgb_factors_bias(self):
        return self._normalised_rgb()[1]


def size_empty_latents() -> None:
    """Wrap comfy.sample.fix_empty_latent_channels (once) as the module docstring says."""
    original = comfy.sample.fix_empty_latent_channels
    if getattr(original, "qwen21_sizing", False):
        return
    carries_scale = "downscale_ratio_spacial" in inspect.signature(original).parameters

    @functools.wraps(original)
    def fix_empty_latent_channels(model, latent_image, *args, **kwargs):
        latent_format = model.get_model_object("latent_format")
        if not isinstance(latent_format, Qwen21LatentFormat) or not _empty_of_another_model(latent_image):
            return original(model, latent_image, *args, **kwargs)
        scale = kwargs.get("downscale_ratio_spacial", args[0] if args else None)
        if scale is None and not carries_scale:
            scale = OLDER_EMPTY_LATENT_SCALE
        if scale is None:  # a newer ComfyUI and a node that says nothing of its scale: as ComfyUI does
            return original(model, latent_image, *args, **kwargs)
        height, width = (side * scale for side in latent_image.shape[-2:])
        if height % LATENT_SCALE or width % LATENT_SCALE:
            raise EmptyLatentSizeError(
                f"Qwen21 MODEL: the empty LATENT is {width}x{height} px; Qwen-Image-2.1 makes images in steps of "
                f"{LATENT_SCALE} px: set the latent node's width and height to multiples of {LATENT_SCALE} (for "
                f"example {_multiple(width, 0)}x{_multiple(height, 0)} or "
                f"{_multiple(width, 1)}x{_multiple(height, 1)}), or use Qwen21 Empty Latent"
            )
        if carries_scale:
            return original(model, latent_image, *args, **kwargs)
        widened = original(model, latent_image, *args, **kwargs)
        shape = (*widened.shape[:-2], height // LATENT_SCALE, width // LATENT_SCALE)
        return torch.zeros(shape, dtype=widened.dtype, device=widened.device)

    fix_empty_latent_channels.qwen21_sizing = True
    comfy.sample.fix_empty_latent_channels = fix_empty_latent_channels


def _empty_of_another_model(latent: torch.Tensor) -> bool:
    """Zeros with other channels than ours: an empty latent made for another model's latent space."""
    ours = Qwen21LatentFormat.latent_channels
    return (isinstance(latent, torch.Tensor) and latent.dim() == 4 and latent.shape[1] != ours
            and not bool(torch.count_nonzero(latent)))  # fmt: skip


def _multiple(side: int, up: int) -> int:
    """The multiple of LATENT_SCALE below `side` (up=0) or above it (up=1)."""
    return max(LATENT_SCALE, (side // LATENT_SCALE + up) * LATENT_SCALE)
