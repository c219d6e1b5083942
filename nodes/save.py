"""Save images as PNG on every core: the same files as ComfyUI's Save Image, in less time."""

from __future__ import annotations

import json

import torch

from ..qwen21_core.png import write_png
from . import host

COMPRESS_LEVEL = 4  # ComfyUI's SaveImage's


def image_bytes(image: torch.Tensor) -> torch.Tensor:
    """IMAGE [H, W, C] float 0..1 -> uint8, truncated as ComfyUI's SaveImage does (255 * x, clipped, cast); NaN as
    0."""
    return (255.0 * image.float()).nan_to_num(0.0).clamp(0, 255).to(torch.uint8)


class Qwen21SaveImage:
    """Saves images to ComfyUI's output folder as PNG, with the prompt and the workflow in them (drag one onto
    ComfyUI to load its workflow), like Save Image, and named like it (<prefix>_00001_.png). The PNG is compressed
    in bands of rows on every CPU core instead of one."""

    CATEGORY = "Qwen21"
    DESCRIPTION = __doc__
    RETURN_TYPES = ()
    FUNCTION = "save_images"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "images": ("IMAGE", {"tooltip": "The images to save: RGB, or RGBA from JoinImageWithAlpha."}),
                "filename_prefix": (
                    "STRING",
                    {
                        "default": "ComfyUI",
                        "tooltip": "File name prefix, as in Save Image: a/b puts the files in the subfolder a of the "
                        "output folder; %width%, %height% and %year% to %second% are filled in.",
                    },
                ),
            },
            "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"},
        }

    def save_images(self, images, filename_prefix="ComfyUI", prompt=None, extra_pnginfo=None):
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or not 1 <= images.shape[-1] <= 4:
            shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"images must be an IMAGE [B, H, W, 3 or 4], got {shape}")
        if images.shape[0] == 0 or images.shape[1] == 0 or images.shape[2] == 0:
            raise ValueError(f"images is empty: {tuple(images.shape)}")
        text = {}
        if not host.metadata_disabled():
            if prompt is not None:
                text["prompt"] = json.dumps(prompt)
            for key, value in (extra_pnginfo or {}).items():
                text[key] = json.dumps(value)
        files = host.image_files(filename_prefix, len(images), images.shape[2], images.shape[1])
        for image, (path, _entry) in zip(images, files, strict=True):
            write_png(path, image_bytes(image).cpu().numpy(), text, COMPRESS_LEVEL)
        return {"ui": {"images": [entry for _path, entry in files]}}
