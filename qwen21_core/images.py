"""Condition images: input formats -> RGBA, the reference resize, and the two copies the model reads.

Accepted inputs, one condition image each unless noted:

* ComfyUI IMAGE tensors, float 0..1, [B, H, W, 3|4] (each batch entry is one image) or [H, W, 3|4],
  optionally with a ComfyUI MASK [B|1, H, W] or [H, W] holding 1 - alpha (what LoadImage and
  SplitImageWithAlpha produce). A MASK must have its image's size; one of another size is refused (it is
  another image's alpha), unless it holds one value everywhere, which means the same at any size (LoadImage
  gives a 64x64 zero mask for an image without alpha);
* PIL images of any mode (converted to RGBA, as the reference does);
* numpy arrays [H, W], [H, W, 3|4], uint8 0..255 or float 0..1.

Floats are quantised to 8 bits (round to nearest), because the reference resizes with PIL: a
LoadImage tensor (bytes / 255) gets its exact bytes back.

Each image is resized ONCE, with PIL lanczos on the RGBA image, to the area output_resolution^2 with
sides rounded to multiples of 32 (diffusers' `calculate_dimensions` + `VaeImageProcessor.resize`). From
that one resize come
* the VLM copy: RGB, alpha composited over white (what the vision tower was trained on), and
* the VAE copy: all four channels, float32 [1, H, W, 4] in 0..1 (the VAE reads the alpha).

Both are kept per source image by `reference_cache.ReferenceCache`, with the image's VAE latents, so a reference
used again with a changed prompt is neither resized nor VAE-encoded again.

Sizes are multiples of 32 because one `<|image_pad|>` token of Qwen3-VL (16-pixel patches, 2x2 merge)
must stand for one 2x2 group of 16x-downsampled latent tokens.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

SIZE_MULTIPLE = 32
# The largest side (width, height, output_resolution) the core accepts: the nodes' widgets allow the same. A value
# can also come through a link or a LATENT's size, so the core checks it before it allocates anything.
MAX_SIDE = 4096
MAX_CONDITION_IMAGES = 16  # per prompt (encoding.py says why 16)


@dataclass
class ConditionImage:
    """One condition image, resized, in the two forms the encoders read.

    vlm:          PIL RGB [height, width], alpha composited over white, for Qwen3-VL.
    rgba:         uint8 [height, width, 4], the resized RGBA (the VAE copy is made from it when asked for).
    source_size:  (width, height) of the input before resizing.
    digest:       sha256 of the source RGBA and its size: the image's identity in caches and content hashes
                  (the resize is a function of the source and the output resolution).
    """

    vlm: Image.Image
    rgba: np.ndarray
    width: int
    height: int
    source_size: tuple[int, int]
    digest: str

    @property
    def vae(self) -> torch.Tensor:
        """float32 [1, height, width, 4] in 0..1, RGBA, for the VAE: the reference's arithmetic (uint8 -> float32 /
        255). Made on demand: 16 MB at 1024^2, which an image whose latents are cached never needs."""
        return torch.from_numpy(self.rgba.astype(np.float32) / 255.0)[None]

    @property
    def pad_tokens(self) -> int:
        """<|image_pad|> tokens = latent tokens / 4 = (H/32) * (W/32)."""
        return (self.height // SIZE_MULTIPLE) * (self.width // SIZE_MULTIPLE)


# -- sizes ------------------------------------------------------------------------------------------


def _round_to_multiple(value: float, multiple: int = SIZE_MULTIPLE) -> int:
    return round(value / multiple) * multiple  # Python's round: ties to even, like the reference


def calculate_dimensions(target_area: float, aspect_ratio: float) -> tuple[int, int]:
    """(width, height) with width / height ~= aspect_ratio and area ~= target_area, multiples of 32."""
    if aspect_ratio <= 0 or target_area <= 0:
        raise ValueError(f"target_area and aspect_ratio must be positive, got {target_area} and {aspect_ratio}")
    exact_width = math.sqrt(target_area * aspect_ratio)
    width, height = _round_to_multiple(exact_width), _round_to_multiple(exact_width / aspect_ratio)
    if width == 0 or height == 0:
        raise ValueError(
            f"an image with aspect ratio {aspect_ratio:.4g} (width / height) at area {target_area:g} rounds to "
            f"{width}x{height} pixels; use a less extreme aspect ratio or a larger output_resolution"
        )
    return width, height


def _nearest_valid(value: int) -> int:
    return max(SIZE_MULTIPLE, _round_to_multiple(value))


def check_output_size(width: int, height: int) -> None:
    """Raise ValueError unless width and height are positive multiples of 32 up to MAX_SIDE (naming the nearest
    valid one)."""
    check_output_side("width", width)
    check_output_side("height", height)


def check_output_side(name: str, value: int) -> None:
    """One side of `check_output_size`, named `name` in the error."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of pixels, got {type(value).__name__}")
    if value > MAX_SIDE:
        raise ValueError(f"{name} {value} is more than {MAX_SIDE} pixels, the largest side qwen21-nodes samples")
    if value < SIZE_MULTIPLE or value % SIZE_MULTIPLE:
        raise ValueError(
            f"{name} {value} is not a positive multiple of {SIZE_MULTIPLE} (the VAE downsamples 16x and the "
            f"model groups 2x2 latent tokens); use {_nearest_valid(value)}"
        )


def derive_output_size(
    source_sizes: Sequence[tuple[int, int]],
    output_resolution: int,
    width: int | None = None,
    height: int | None = None,
) -> tuple[int, int]:
    """The output (width, height): given values win; otherwise the LAST condition image's aspect ratio at
    area output_resolution^2, or output_resolution x output_resolution without condition images.

    `source_sizes` are the condition images' (width, height) before resizing. The result is checked with
    `check_output_size`.
    """
    if source_sizes:
        last_width, last_height = source_sizes[-1]
        derived_width, derived_height = calculate_dimensions(output_resolution**2, last_width / last_height)
    else:
        derived_width = derived_height = output_resolution
    width = derived_width if width is None else width
    height = derived_height if height is None else height
    check_output_size(width, height)
    return width, height


# -- input formats -> RGBA --------------------------------------------------------------------------


def _float_to_bytes(array: np.ndarray) -> np.ndarray:
    return np.rint(np.clip(array, 0.0, 1.0) * 255.0).astype(np.uint8)


def _array_to_rgba(array: np.ndarray, what: str) -> Image.Image:
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if not (array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (3, 4))):
        raise ValueError(f"{what} must be [H, W], [H, W, 3] or [H, W, 4] (channels last), got shape {array.shape}")
    if array.dtype == np.uint8:
        pass
    elif np.issubdtype(array.dtype, np.floating):
        array = _float_to_bytes(array)
    else:
        raise TypeError(f"{what} must hold uint8 (0..255) or float (0..1) values, got dtype {array.dtype}")
    return Image.fromarray(np.ascontiguousarray(array)).convert("RGBA")


def masks_at_image_size(masks: torch.Tensor, height: int, width: int, mask_name: str = "mask",
                        image_name: str = "its image") -> torch.Tensor:  # fmt: skip
    """ComfyUI MASK [B, h, w] -> [B, height, width]: as it is when it has the image's size; a mask of one value
    everywhere (LoadImage's 64x64 zero mask for an image without alpha, a solid mask) filled at the image's size;
    any other size refused, naming both sizes. Native nodes such as JoinImageWithAlpha stretch a mask to their
    image, but a condition image's mask is its alpha: one of another size belongs to another image, and
    stretched it would cut the subject out in the wrong place without a word."""
    if tuple(masks.shape[-2:]) == (height, width):
        return masks
    flat = masks.reshape(masks.shape[0], -1)
    if flat.shape[1] and bool((flat == flat[:, :1]).all()):
        return flat[:, :1, None].expand(-1, height, width)
    raise ValueError(
        f"{mask_name} is {masks.shape[-1]}x{masks.shape[-2]} pixels but {image_name} is {width}x{height} (width x "
        "height): a mask must have the size of the image whose alpha it is (LoadImage gives both at the image's "
        f"size). Connect the mask that belongs to {image_name}, or resize it first (Convert Mask to Image, Upscale "
        "Image, Convert Image to Mask)."
    )


def _mask_to_alpha(mask: torch.Tensor | np.ndarray, height: int, width: int, what: str, image_name: str) -> np.ndarray:
    """ComfyUI MASK (1 = transparent) [H, W] -> uint8 alpha [height, width]."""
    mask = torch.as_tensor(mask, dtype=torch.float32).detach().cpu()
    if mask.dim() != 2:
        raise ValueError(f"{what} must be one [H, W] mask here, got shape {tuple(mask.shape)}")
    mask = masks_at_image_size(mask[None], height, width, what, image_name)[0]
    return _float_to_bytes((1.0 - mask).numpy())


def to_rgba(image, mask=None, what: str = "image") -> Image.Image:
    """One image (PIL, numpy [H,W(,C)], or torch [H,W,C] float 0..1) -> PIL RGBA.

    `mask` (ComfyUI MASK, 1 - alpha, [H, W]) sets the alpha of an image without one.
    """
    if isinstance(image, Image.Image):
        has_alpha = "A" in image.getbands() or "transparency" in image.info
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
    elif isinstance(image, np.ndarray):
        has_alpha = image.ndim == 3 and image.shape[-1] == 4
        rgba = _array_to_rgba(image, what)
    elif isinstance(image, torch.Tensor):
        if image.dim() != 3 or image.shape[-1] not in (3, 4):
            raise ValueError(
                f"{what} must be a ComfyUI IMAGE [B, H, W, 3|4] or one image [H, W, 3|4], got shape "
                f"{tuple(image.shape)}"
            )
        has_alpha = image.shape[-1] == 4
        pixels = image.detach().cpu()
        rgba = _array_to_rgba((pixels.float() if pixels.is_floating_point() else pixels).numpy(), what)
    else:
        raise TypeError(
            f"{what} must be a ComfyUI IMAGE tensor, a PIL image or a numpy array, got {type(image).__name__}"
        )
    if mask is not None:
        if has_alpha:
            raise ValueError(
                f"{what} already has an alpha channel and a mask was given too; pass one of them "
                f"(MASK = 1 - alpha, as LoadImage outputs it)"
            )
        rgba = rgba.copy()
        rgba.putalpha(Image.fromarray(_mask_to_alpha(mask, rgba.height, rgba.width, f"the mask of {what}", what)))
    return rgba


def condition_images_from_comfy(image: torch.Tensor, mask: torch.Tensor | None = None) -> list[Image.Image]:
    """ComfyUI IMAGE [B, H, W, 3|4] (+ MASK [B|1, H, W] or [H, W], 1 - alpha) -> B RGBA images."""
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"image must be a ComfyUI IMAGE tensor [B, H, W, C], got {type(image).__name__}")
    if image.dim() == 3:
        image = image[None]
    if image.dim() != 4:
        raise ValueError(f"image must be a ComfyUI IMAGE [B, H, W, 3|4], got shape {tuple(image.shape)}")
    masks: list = [None] * image.shape[0]
    if mask is not None:
        mask = torch.as_tensor(mask)
        if mask.dim() == 2:
            mask = mask[None]
        if mask.dim() != 3 or mask.shape[0] not in (1, image.shape[0]):
            raise ValueError(
                f"mask must be a ComfyUI MASK [B, H, W] with B = 1 or the image batch {image.shape[0]}, got "
                f"shape {tuple(mask.shape)}"
            )
        masks = [mask[min(i, mask.shape[0] - 1)] for i in range(image.shape[0])]
    return [to_rgba(image[i], masks[i], what=f"image[{i}]") for i in range(image.shape[0])]


def condition_images_to_rgba(images, masks=None) -> list[Image.Image]:
    """Any accepted input -> list of RGBA images, in slot order.

    images: one input or a sequence of inputs; a batched ComfyUI IMAGE [B, H, W, C] counts as B images.
    masks:  None, one mask (for a single input), or a sequence with one entry (mask or None) per input.
    """
    if images is None:
        return []
    single = isinstance(images, (Image.Image, np.ndarray, torch.Tensor))
    items = [images] if single else list(images)
    if masks is None:
        mask_items = [None] * len(items)
    elif single or isinstance(masks, (np.ndarray, torch.Tensor)):
        mask_items = [masks]
    else:
        mask_items = list(masks)
    if len(mask_items) != len(items):
        raise ValueError(
            f"masks must have one entry (a MASK or None) per image input: got {len(mask_items)} for {len(items)} images"
        )
    rgba: list[Image.Image] = []
    for index, (item, mask) in enumerate(zip(items, mask_items, strict=True)):
        if isinstance(item, torch.Tensor) and item.dim() == 4:
            rgba.extend(condition_images_from_comfy(item, mask))
        elif isinstance(item, (list, tuple)):
            raise TypeError(f"images[{index}] is a {type(item).__name__}; pass one flat sequence of images")
        else:
            rgba.append(to_rgba(item, mask, what=f"images[{index}]"))
    return rgba


# -- the reference resize and the two copies --------------------------------------------------------


def source_digest(rgba: Image.Image) -> str:
    """sha256 of an RGBA image's size and bytes (4 MB at 1024^2, a few ms)."""
    digest = hashlib.sha256(f"{rgba.width}x{rgba.height}:".encode())
    digest.update(np.asarray(rgba).data)
    return digest.hexdigest()


def prepare_condition_image(rgba: Image.Image, output_resolution: int, digest: str | None = None) -> ConditionImage:
    """Resize one RGBA image to area output_resolution^2 (multiples of 32) and make the VLM and VAE copies.
    digest: `source_digest(rgba)` where the caller has it already."""
    if rgba.mode != "RGBA":
        raise ValueError(f"prepare_condition_image needs an RGBA image, got mode {rgba.mode}; use to_rgba first")
    width, height = calculate_dimensions(output_resolution**2, rgba.width / rgba.height)
    # PIL resizes RGBA with premultiplied alpha; the reference relies on exactly this call.
    resized = rgba.resize((width, height), resample=Image.Resampling.LANCZOS)
    vlm = Image.new("RGB", (width, height), (255, 255, 255))
    vlm.paste(resized, mask=resized.getchannel("A"))
    return ConditionImage(vlm=vlm, rgba=np.asarray(resized), width=width, height=height, source_size=rgba.size,
                          digest=digest or source_digest(rgba))  # fmt: skip
