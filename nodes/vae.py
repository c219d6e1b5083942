"""VAE nodes: LATENT -> IMAGE + alpha MASK, and IMAGE (+ MASK) -> LATENT."""

from __future__ import annotations

import torch

from ..qwen21_core.images import masks_at_image_size
from ..qwen21_core.request import LATENT_SCALE
from . import host
from .model import MODEL_TYPE, decode_status

LATENT_CHANNELS = 64
SPATIAL_FACTOR = 16
PRECISIONS = {"auto": None, "bf16": "bf16", "fp32": "fp32"}


def _raw_latents(latent: dict) -> torch.Tensor:
    samples = latent["samples"]
    if samples.dim() == 5 and samples.shape[2] == 1:  # a single-frame video-style latent
        samples = samples[:, :, 0]
    if samples.dim() != 4 or samples.shape[1] != LATENT_CHANNELS:
        raise ValueError(
            f"latent must be Qwen-Image-2.1 latents [B, {LATENT_CHANNELS}, H/16, W/16], got {tuple(samples.shape)}; "
            "latents of other models cannot be decoded by this VAE"
        )
    return samples


def _center_crop(pixels: torch.Tensor) -> torch.Tensor:
    """[B, H, W, C] cropped to multiples of 16 around the center, as ComfyUI's VAEEncode does for its VAEs."""
    height, width = pixels.shape[1:3]
    new_height, new_width = height // SPATIAL_FACTOR * SPATIAL_FACTOR, width // SPATIAL_FACTOR * SPATIAL_FACTOR
    if new_height == 0 or new_width == 0:
        raise ValueError(f"image is {height}x{width} pixels; the VAE needs at least {SPATIAL_FACTOR}x{SPATIAL_FACTOR}")
    top, left = (height - new_height) // 2, (width - new_width) // 2
    return pixels[:, top : top + new_height, left : left + new_width]


class Qwen21VAEDecode:
    """Decode latents to RGB + alpha. Untiled whenever it fits (no seams), tiled otherwise, retrying
    smaller tiles on out-of-memory."""

    CATEGORY = "Qwen21"
    DESCRIPTION = __doc__
    RETURN_TYPES = ("IMAGE", "MASK")
    RETURN_NAMES = ("image", "alpha")
    OUTPUT_TOOLTIPS = (
        "RGB image [B, H, W, 3].",
        "Alpha as a ComfyUI MASK (1 - alpha, like LoadImage/SplitImageWithAlpha); JoinImageWithAlpha restores RGBA.",
    )
    FUNCTION = "decode"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "From a Qwen21 loader."}),
                "latent": ("LATENT", {"tooltip": "From the Qwen21 sampler or native ComfyUI Qwen-Image-2.1."}),
                "tiling": (
                    ["auto", "on", "off"],
                    {
                        "default": "auto",
                        "tooltip": "auto: untiled when its activations fit in free VRAM (on a CPU, in a capped "
                        "share of free RAM), else tiled; an exact bf16 decode is planned at 3010 B per output "
                        "pixel, 2.94 GiB at 1024x1024, a fast one at 1901 B "
                        "(BENCHMARKS: VAE). on: always tiled, seams blended: at 1024x1024 with 512 px tiles 176.8 "
                        "ms and 1.30 GiB peak instead of 68.7 ms and 3.29 GiB (BENCHMARKS: VAE). off: never tiled "
                        "(fails if it does not fit).",
                    },
                ),
                "tile_size": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 4096,
                        "step": LATENT_SCALE,  # the multiple the VAE takes (its error names it)
                        "tooltip": "Tile side in pixels when tiling; 0 picks the largest that fits. Smaller tiles "
                        "use less memory and take longer.",
                    },
                ),
                "precision": (
                    list(PRECISIONS),
                    {
                        "default": "auto",
                        "tooltip": "auto: the VAE's loaded dtype. fp32: for exactness checks; its activations are "
                        "planned at 6030 B per output pixel instead of 3010 B in bf16 (BENCHMARKS: VAE); its time "
                        "is not benchmarked.",
                    },
                ),
                "quality": (
                    ["exact", "fast"],
                    {
                        "default": "exact",
                        "tooltip": "exact: the reference decode, bit-identical to diffusers. fast: fused kernels, "
                        "not bit-identical: at 1024x1024 42.5 ms instead of 68.7 ms, 50.9 dB PSNR against exact, "
                        "measured once on an H200 with random weights (BENCHMARKS: VAE); nothing checks it at run "
                        "time.",
                    },
                ),
            }
        }

    def decode(self, model, latent, tiling, tile_size, precision, quality):
        progress = host.Progress(1, "VAE tile")

        def on_tile(done: int, total: int):
            progress.total = total
            progress.update(done)

        rgba = model.decode(
            _raw_latents(latent),
            tiling=tiling,
            tile_size=tile_size or None,
            precision=PRECISIONS[precision],
            quality=quality,
            callback=on_tile,
            check_interrupt=host.check_interrupted,  # Cancel also stops inside one untiled decode
        )
        rgba = rgba.to(host.intermediate_device(), torch.float32)
        stats = dict(model.pipe.last_decode_stats or {})
        return {
            "ui": {"qwen21_stats": [stats], "qwen21_status": [decode_status(stats)]},
            "result": (rgba[..., :3].contiguous(), 1.0 - rgba[..., 3]),
        }


class Qwen21VAEEncode:
    """Encode images (with optional alpha) to Qwen-Image-2.1 latents, e.g. as a start for denoise < 1."""

    CATEGORY = "Qwen21"
    DESCRIPTION = __doc__
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    OUTPUT_TOOLTIPS = ("Raw VAE-space latents [B, 64, H/16, W/16].",)
    FUNCTION = "encode"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "From a Qwen21 loader."}),
                "image": (
                    "IMAGE",
                    {"tooltip": "RGB or RGBA images [B, H, W, 3|4]; cropped around the center to multiples of 16."},
                ),
            },
            "optional": {
                "mask": (
                    "MASK",
                    {
                        "tooltip": "Alpha as a ComfyUI MASK (1 - alpha); without it the image is opaque. It must have "
                        "the image's size (another size is refused, not stretched), except a mask of one value, such "
                        "as LoadImage's 64x64 one for an image without alpha, which fills the image."
                    },
                ),
            },
        }

    def encode(self, model, image, mask=None):
        if image.dim() != 4 or image.shape[-1] not in (3, 4):
            raise ValueError(f"image must be an IMAGE [B, H, W, 3|4], got shape {tuple(image.shape)}")
        if mask is not None:
            mask = masks_at_image_size(mask.reshape(-1, *mask.shape[-2:]).float(), *image.shape[1:3], "mask", "image")
            mask = _center_crop(mask[..., None])[..., 0]
        latents = model.encode_image(_center_crop(image), mask)
        return ({"samples": latents.to(host.intermediate_device())},)
