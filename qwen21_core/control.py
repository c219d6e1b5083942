"""Control and inpainting for one sampling run: what the user gave (`Control`), the 129-channel context the branch reads
(`control_context`) and which steps it is on (`active_steps`).

The context per latent pixel, as native ComfyUI's QwenImage21FunControlNetApply and the reference pipelines make it:
- 64 channels: the control image (canny, depth, pose, ...) stretched to the output size (bicubic), VAE-encoded and
  normalised ((z - mean) / std); zeros without one;
- 1 channel: keep = 1 - the mask (a ComfyUI MASK, 1 = regenerate, stretched bilinear, >= 0.5) at latent size
  (nearest); without a mask everything is regenerated (keep 0);
- 64 channels: the inpaint image with the regenerated region set to mid-grey, encoded and normalised; zeros without
  an inpaint image or without a mask (the inpaint image is only read with a mask).
Only the first image of a batch is used. RGB is encoded as opaque (alpha 1), as ComfyUI's VAE pads it.

Steps: a step is controlled when its place in the schedule lies from `start` to `end` (0 = the start, 1 = the end), as
native's start_percent / end_percent; our sampler measures the place on the unshifted grid (the fraction of the
released schedule's steps before it; scheduler.py step_percents), KSampler through its model sampling's
percent_to_sigma, as native does. Outside, the step is the plain model's.
"""

from __future__ import annotations

import hashlib
import numbers
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

STRENGTH_RANGE = (-10.0, 10.0)  # native's widget range
PERCENT_TOLERANCE = 1e-6  # a step's place computed in float32 may sit a rounding off the percent it was set at
CONTEXTS_KEPT = 4  # prepared contexts kept per pipeline (a few sizes of one control, or a few controls)


def _digest(tensor: torch.Tensor | None) -> str | None:
    if tensor is None:
        return None
    data = tensor.detach().to("cpu", torch.float32).contiguous()
    return hashlib.sha256(data.numpy().tobytes() + str(tuple(data.shape)).encode()).hexdigest()[:32]


@dataclass(frozen=True, eq=False)
class Control:
    """net: a loaded FunControlNet (dit/control.py); strength: how much of the branch is added (0 = off);
    start, end: the part of the schedule it runs in (0..1); image: a ComfyUI IMAGE [B, H, W, C] (first image used);
    inpaint_image: IMAGE, read only with `mask`; mask: a ComfyUI MASK [B, H, W] or [H, W], 1 = regenerate."""

    net: object
    strength: float = 1.0
    start: float = 0.0
    end: float = 1.0
    image: torch.Tensor | None = None
    inpaint_image: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self):
        low, high = STRENGTH_RANGE
        if not isinstance(self.strength, numbers.Real) or not (low <= self.strength <= high):
            raise ValueError(f"control strength must be a number from {low} to {high}, got {self.strength!r:.40}")
        for name in ("start", "end"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
                raise ValueError(f"control {name}_percent must be from 0 to 1, got {value!r:.40}")
        for name in ("image", "inpaint_image"):
            _check_image(name, getattr(self, name))
        if self.mask is not None:
            mask = self.mask
            if not isinstance(mask, torch.Tensor) or mask.dim() not in (2, 3) or 0 in mask.shape:
                got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
                raise ValueError(f"control mask must be a MASK [B, H, W] or [H, W] (1 = regenerate), got {got}")
        if self.image is None and self.mask is None:
            raise ValueError("control needs a control_image, or a mask (inpainting), or both")
        object.__setattr__(self, "_identity", None)

    @property
    def on(self) -> bool:
        """Whether the branch changes anything (strength 0 is the plain model, exactly)."""
        return self.strength != 0 and self.start <= self.end

    @property
    def identity(self) -> tuple:
        """What the prepared context depends on (the net and the images' content), for caching it."""
        if self._identity is None:
            images = tuple(_digest(t) for t in (self.image, self.inpaint_image if self.mask is not None else None,
                                                self.mask))  # fmt: skip
            object.__setattr__(self, "_identity", (id(self.net), images))
        return self._identity

    @property
    def prefix_key(self) -> tuple:
        """What a controlled branch's prefix K/V depend on beyond the conditioning: the branch's weights and the
        strength (not the images: the prefix rows never see the control context)."""
        return (id(self.net), self.net.weights_id, float(self.strength))


def _check_image(name: str, image) -> None:
    if image is None:
        return
    if not isinstance(image, torch.Tensor) or image.dim() != 4 or image.shape[-1] not in (3, 4) or 0 in image.shape:
        got = list(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise ValueError(f"control {name} must be a ComfyUI IMAGE [B, H, W, 3 or 4], got {got}")
    if not image.is_floating_point():
        raise ValueError(f"control {name} must be a float IMAGE in 0..1, got {image.dtype}")


def _stretched(image: torch.Tensor, height: int, width: int, mode: str) -> torch.Tensor:
    """[B, C, H, W] -> [B, C, height, width], as ComfyUI's common_upscale (no crop, no antialias)."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    return F.interpolate(image, size=(height, width), mode=mode)


@torch.no_grad()
def control_context(control: Control, encode: Callable[[torch.Tensor], torch.Tensor], latents_mean: torch.Tensor,
                    latents_std: torch.Tensor, latent_size: tuple[int, int]) -> torch.Tensor:  # fmt: skip
    """The branch's input for an output of `latent_size` (h, w): [h * w, 129] float32 on the CPU, latent pixels in
    raster order. encode: ComfyUI IMAGE [1, H, W, 3] in 0..1 -> raw latents [1, 64, H/16, W/16] (the pipeline's VAE)."""
    h, w = latent_size
    height, width = 16 * h, 16 * w
    mean = latents_mean.float().reshape(1, -1, 1, 1)
    std = latents_std.float().reshape(1, -1, 1, 1)

    def latents(pixels_nchw: torch.Tensor) -> torch.Tensor:
        raw = encode(pixels_nchw.permute(0, 2, 3, 1).contiguous()).float().cpu()
        return (raw - mean) / std

    channels = mean.shape[1]
    hint = torch.zeros(1, channels, h, w)
    if control.image is not None:
        image = control.image[:1, ..., :3].float().cpu().permute(0, 3, 1, 2)
        hint = latents(_stretched(image, height, width, "bicubic"))
    regenerate = torch.ones(1, 1, height, width)
    if control.mask is not None:
        mask = control.mask if control.mask.dim() == 3 else control.mask[None]
        mask = mask[:1, None].float().cpu()
        regenerate = (_stretched(mask, height, width, "bilinear") >= 0.5).float()
    inpaint = torch.zeros(1, channels, h, w)
    if control.inpaint_image is not None and control.mask is not None:
        image = control.inpaint_image[:1, ..., :3].float().cpu().permute(0, 3, 1, 2)
        image = _stretched(image, height, width, "bicubic")
        inpaint = latents(image * (1 - regenerate) + 0.5 * regenerate)
    keep = 1 - F.interpolate(regenerate, size=(h, w), mode="nearest")
    context = torch.cat([hint, keep, inpaint], dim=1)  # [1, 129, h, w]
    return context[0].flatten(1).transpose(0, 1).contiguous()


class ControlContexts:
    """The last few prepared contexts, by (control identity, latent size): a rerun with a new seed or prompt does not
    encode the control image again."""

    def __init__(self, kept: int = CONTEXTS_KEPT):
        self.kept = kept
        self.entries: OrderedDict = OrderedDict()

    def get(self, control: Control, latent_size, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        key = (control.identity, tuple(latent_size))
        if key in self.entries:
            self.entries.move_to_end(key)
            return self.entries[key]
        context = make()
        self.entries[key] = context
        while len(self.entries) > self.kept:
            self.entries.popitem(last=False)
        return context

    def clear(self) -> None:
        self.entries.clear()


def active_steps(percents, start: float, end: float) -> list[bool]:
    """Per step (how far through the schedule it starts, scheduler.py step_percents) whether control is on."""
    return [start - PERCENT_TOLERANCE <= p <= end + PERCENT_TOLERANCE for p in percents]
