"""What one sampling run is asked to make: one `SampleRequest`, checked once where it is built (the sampler node, or
`Qwen21Pipeline.sample` from its keywords) and passed on unchanged through the model handle, the memory sizing, the
pipeline and the sampler, instead of the same arguments declared again at every layer.

How the run computes it (prefix cache, graphs, K/V format, several GPUs) is `SampleOptions` (options.py): the
request says what comes out, the options how.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .images import check_output_side

SCHEDULES = ("default", "turbo")
LATENT_SCALE = 16  # pixels per latent token side
MAX_BATCH = 16  # images per conditioning and run: the Sampler node's maximum, checked before the noise is drawn


@dataclass(frozen=True, eq=False)
class SampleRequest:
    """height, width:  output pixels, multiples of 32; None (or 0): the size the conditioning derived (`sized`).
    steps:          denoising steps of the schedule (custom sigmas bring their own count).
    true_cfg_scale: 1 = no guidance; above 1 the negative prompt guides and every step runs both branches.
    seed:           the noise's seed (drawn on the CPU in fp32, as ComfyUI's KSampler draws it); or `noise` itself,
                    raw latents [rows, C, h, w] for every conditioning's batch in order.
    batch_size:     images per conditioning, all sharing its prefix.
    sigmas:         a custom base grid, falling values in (0, 1] (the terminal 0 implied); None: `schedule` decides.
    schedule:       "default" (the released schedule over `steps`) or "turbo" (the checkpoint's own sigmas).
    start_latents:  raw latents to start from at denoise < 1 (img2img); denoise: the fraction of the schedule run.
    callback:       callback(step, total, x0_raw_latents) after each step; raise in it to interrupt.
    control:        a control.Control (Fun-Control: control image, inpainting) or None.
    """

    height: int | None = None
    width: int | None = None
    steps: int = 40
    true_cfg_scale: float = 1.0
    seed: int = 0
    noise: torch.Tensor | None = None
    batch_size: int = 1
    sigmas: Sequence[float] | None = None
    schedule: str = "default"
    start_latents: torch.Tensor | None = None
    denoise: float = 1.0
    callback: Callable | None = None
    control: object | None = None

    def __post_init__(self):
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is None or (value == 0 and not isinstance(value, bool)):
                object.__setattr__(self, name, None)  # 0: derived, as the sampler node's widgets say
            else:
                check_output_side(name, value)
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be >= 1 (an integer), got {value!r:.40}")
        if self.batch_size > MAX_BATCH:
            raise ValueError(f"batch_size must be from 1 to {MAX_BATCH} (the Sampler node's maximum), got "
                             f"{self.batch_size}")  # fmt: skip
        if not isinstance(self.true_cfg_scale, numbers.Real) or not self.true_cfg_scale >= 1.0:
            raise ValueError(f"true_cfg_scale must be >= 1 (1 = no guidance), got {self.true_cfg_scale}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.noise is not None and not isinstance(self.noise, torch.Tensor):
            raise ValueError(f"noise must be a tensor of raw latents [rows, C, h, w], got {type(self.noise).__name__}")
        if self.sigmas is not None:
            object.__setattr__(self, "sigmas", tuple(float(sigma) for sigma in self.sigmas))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES} (or pass sigmas=[...]), got {self.schedule!r}")
        start = self.start_latents
        if start is not None and (not isinstance(start, torch.Tensor) or start.dim() != 4):
            shape = list(start.shape) if isinstance(start, torch.Tensor) else type(start).__name__
            raise ValueError(f"start_latents must be raw latents [B, C, h, w], got {shape}")
        if not isinstance(self.denoise, numbers.Real) or not 0.0 < self.denoise <= 1.0:
            raise ValueError(f"denoise must be in (0, 1], got {self.denoise}")
        if self.callback is not None and not callable(self.callback):
            raise ValueError(f"callback must be callable, got {type(self.callback).__name__}")
        if self.control is not None and not hasattr(self.control, "net"):
            raise ValueError(f"control must be a qwen21_core.control.Control, got {type(self.control).__name__}")

    @property
    def controlled(self) -> bool:
        """Whether a control branch changes this run (a control at strength 0 is the plain model)."""
        return self.control is not None and self.control.on

    def replace(self, **changes) -> SampleRequest:
        return dataclasses.replace(self, **changes)

    def sized(self, cond) -> SampleRequest:
        """This request with the size `cond` (a Conditioning) derived wherever none was asked for."""
        if self.height is not None and self.width is not None:
            return self
        return self.replace(height=self.height or cond.height, width=self.width or cond.width)

    @property
    def guided(self) -> bool:
        """Whether the negative prompt guides (when the conditioning has one)."""
        return self.true_cfg_scale > 1

    @property
    def latent_size(self) -> tuple[int, int]:
        """(h, w) of the output's latent grid; the request must be sized."""
        if self.height is None or self.width is None:
            raise ValueError("this request has no size yet: size it from its conditioning first (sized)")
        return self.height // LATENT_SCALE, self.width // LATENT_SCALE

    @property
    def target_tokens(self) -> int:
        h, w = self.latent_size
        return h * w

    def base_sigmas(self, checkpoint_sigmas: Sequence[float] | None) -> tuple[float, ...] | None:
        """The base grid the sampler runs: the sigmas asked for, else the checkpoint's own `sample_sigmas` (a turbo
        checkpoint's: the reference runs them whenever they exist), else None (the default grid over `steps`)."""
        if self.sigmas is not None:
            return self.sigmas
        if self.schedule == "turbo" and not checkpoint_sigmas:
            raise ValueError(
                "schedule='turbo' needs the checkpoint's sample_sigmas (model_index.json of a turbo checkpoint); "
                "this checkpoint has none: use schedule='default' or pass custom sigmas"
            )
        return tuple(float(sigma) for sigma in checkpoint_sigmas) if checkpoint_sigmas else None
