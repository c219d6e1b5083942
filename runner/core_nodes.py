"""Small stand-ins for the ComfyUI core nodes our workflows use, for the in-process runner.

Same class names, inputs, outputs and tensor conventions as ComfyUI's LoadImage, SaveImage,
PreviewImage, JoinImageWithAlpha and SplitImageWithAlpha (IMAGE [B,H,W,C] float 0..1, MASK [B,H,W]
= 1 - alpha), so one API-format workflow runs both here and in ComfyUI. They read from and write to
the folders the runner is given instead of ComfyUI's input/ and output/.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from ..nodes import host

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def load_image_file(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """IMAGE [1,H,W,3] and MASK [1,H,W] (1 - alpha; a 64x64 zero mask when there is no alpha, as ComfyUI)."""
    with Image.open(path) as opened:
        picture = ImageOps.exif_transpose(opened)
        image = torch.from_numpy(np.asarray(picture.convert("RGB"), dtype=np.float32) / 255.0)[None]
        if "A" in picture.getbands() or (picture.mode == "P" and "transparency" in picture.info):
            alpha = np.asarray(picture.convert("RGBA").getchannel("A"), dtype=np.float32) / 255.0
            mask = 1.0 - torch.from_numpy(alpha)[None]
        else:
            mask = torch.zeros((1, 64, 64), dtype=torch.float32)
    return image, mask


def save_image_batch(images: torch.Tensor, folder: str, filename_prefix: str) -> list[dict]:
    """Write each [H,W,3|4] image as an RGB or RGBA PNG named <prefix>_00001_.png, as ComfyUI's SaveImage does
    (PIL, compression level 4, one core)."""
    files = host.image_files(filename_prefix, len(images), images.shape[2], images.shape[1], folder)
    for image, (path, _entry) in zip(images, files, strict=True):
        pixels = np.clip(255.0 * image.detach().cpu().float().numpy(), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(path, compress_level=4)
    return [entry for _path, entry in files]


def make_core_nodes(input_dir: str, output_dir: str, temp_dir: str) -> dict[str, type]:
    """The stand-in node classes, bound to the runner's input, output and temp folders."""

    class LoadImage:
        CATEGORY = "image"
        RETURN_TYPES = ("IMAGE", "MASK")
        FUNCTION = "load_image"

        @classmethod
        def INPUT_TYPES(cls):
            files = sorted(
                f
                for f in (os.listdir(input_dir) if os.path.isdir(input_dir) else [])
                if f.lower().endswith(IMAGE_EXTENSIONS)
            )
            return {"required": {"image": (files, {"image_upload": True})}}

        @classmethod
        def IS_CHANGED(cls, image):  # as ComfyUI's: an image replaced under the same name is read again
            stat = os.stat(os.path.join(input_dir, image))
            return stat.st_size, stat.st_mtime_ns

        def load_image(self, image):
            return load_image_file(os.path.join(input_dir, image))

    class SaveImage:
        CATEGORY = "image"
        RETURN_TYPES = ()
        FUNCTION = "save_images"
        OUTPUT_NODE = True
        folder, kind = output_dir, "output"

        @classmethod
        def INPUT_TYPES(cls):
            return {
                "required": {"images": ("IMAGE",), "filename_prefix": ("STRING", {"default": "ComfyUI"})},
                "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"},
            }

        def save_images(self, images, filename_prefix="ComfyUI", prompt=None, extra_pnginfo=None):
            saved = save_image_batch(images, self.folder, filename_prefix)
            for entry in saved:
                entry["type"] = self.kind
            return {"ui": {"images": saved}}

    class PreviewImage(SaveImage):
        folder, kind = temp_dir, "temp"

        @classmethod
        def INPUT_TYPES(cls):
            return {
                "required": {"images": ("IMAGE",)},
                "hidden": {"prompt": "PROMPT", "extra_pnginfo": "EXTRA_PNGINFO"},
            }

        def save_images(self, images, filename_prefix="ComfyUI_temp", prompt=None, extra_pnginfo=None):
            return super().save_images(images, filename_prefix, prompt, extra_pnginfo)

    class JoinImageWithAlpha:
        CATEGORY = "mask/compositing"
        RETURN_TYPES = ("IMAGE",)
        FUNCTION = "join"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"image": ("IMAGE",), "alpha": ("MASK",)}}

        def join(self, image, alpha):
            count = min(len(image), len(alpha))
            alpha = alpha.reshape(-1, 1, *alpha.shape[-2:]).float()
            alpha = 1.0 - F.interpolate(alpha, size=image.shape[1:3], mode="bilinear", align_corners=False)
            return (torch.cat((image[:count, ..., :3], alpha[:count, 0, ..., None]), dim=-1),)

    class SplitImageWithAlpha:
        CATEGORY = "mask/compositing"
        RETURN_TYPES = ("IMAGE", "MASK")
        FUNCTION = "split"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"image": ("IMAGE",)}}

        def split(self, image):
            alpha = image[..., 3] if image.shape[-1] > 3 else torch.ones_like(image[..., 0])
            return image[..., :3], 1.0 - alpha

    return {cls.__name__: cls for cls in (LoadImage, SaveImage, PreviewImage, JoinImageWithAlpha, SplitImageWithAlpha)}
