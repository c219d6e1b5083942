"""Flow-matching Euler schedule, bit-identical to diffusers' FlowMatchEulerDiscreteScheduler.

The base grid (linspace(1, 1/N, N), custom sigmas, or the checkpoint's turbo `sample_sigmas`) is
shifted (dynamic exponential/linear shift from the image's token count, or the static `shift`),
optionally stretched so the last sigma equals `shift_terminal`, and a terminal 0 is appended.
The arithmetic is done in the same dtypes as the reference (float32 numpy, then torch), so the
sigmas and timesteps agree to the bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .config import SchedulerConfig

# At most MAX_STEPS steps run (the Sampler node's widget maximum; every step is a DiT pass, so the count is the
# run's cost). A denoise < 1 takes its steps from the tail of a longer grid: at most MAX_GRID_STEPS long, which
# is MAX_STEPS at the node's smallest denoise 0.01. Both are checked before a grid is built.
MAX_STEPS = 200
MAX_GRID_STEPS = 100 * MAX_STEPS


def resolution_shift(image_seq_len: int, config: SchedulerConfig) -> float:
    """mu: linear in the target's token count between (base_seq, base_shift) and (max_seq, max_shift)."""
    base_len = config.base_image_seq_len if config.base_image_seq_len is not None else 256
    max_len = config.max_image_seq_len if config.max_image_seq_len is not None else 4096
    base_shift = config.base_shift if config.base_shift is not None else 0.5
    max_shift = config.max_shift if config.max_shift is not None else 1.15
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


def _shift(sigmas: np.ndarray, config: SchedulerConfig, mu: float) -> np.ndarray:
    if config.use_dynamic_shifting:
        if config.time_shift_type == "exponential":
            return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
        return mu / (mu + (1 / sigmas - 1) ** 1.0)
    return config.shift * sigmas / (1 + (config.shift - 1) * sigmas)


def _stretch_to_terminal(sigmas: np.ndarray, terminal: float) -> np.ndarray:
    one_minus = 1 - sigmas
    if one_minus[-1] == 0:
        # a grid that ends at sigma 1 (a single step) cannot be stretched: the reference divides by zero
        # and returns NaN sigmas (a black image); leave it unstretched instead
        return sigmas
    return 1 - one_minus / (one_minus[-1] / (1 - terminal))


def flow_schedule(
    config: SchedulerConfig,
    image_seq_len: int,
    steps: int | None = None,
    sigmas: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas [n+1] with the terminal 0, timesteps [n] = sigmas * 1000), both float32 on the CPU.

    steps:   number of steps of the default grid linspace(1, 1/steps, steps), or
    sigmas:  a custom base grid (turbo `sample_sigmas`, or the user's), excluding the terminal sigma.
    """
    grid = _base_grid(steps, sigmas)
    grid = _shift(grid, config, resolution_shift(image_seq_len, config))
    if config.shift_terminal:
        grid = _stretch_to_terminal(grid, config.shift_terminal)
    shifted = torch.from_numpy(np.asarray(grid)).to(torch.float32)
    timesteps = shifted * config.num_train_timesteps
    return torch.cat([shifted, torch.zeros(1)]), timesteps


def _base_grid(steps: int | None, sigmas) -> np.ndarray:
    """The unshifted grid, float32: linspace(1, 1/steps, steps), or the custom sigmas (checked)."""
    if sigmas is None:
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_GRID_STEPS:
            raise ValueError(f"steps must be a positive integer, at most {MAX_GRID_STEPS}, got {steps!r:.40}")
        base = np.linspace(1.0, 1 / steps, steps)
    else:
        base = list(sigmas)
        if not base:
            raise ValueError("sigmas must hold at least one value")
        if len(base) > MAX_GRID_STEPS:
            raise ValueError(f"{len(base)} sigmas; a schedule holds at most {MAX_GRID_STEPS}")
        if any(not (0.0 < float(s) <= 1.0) for s in base):
            raise ValueError(f"sigmas must lie in (0, 1], got {base}")
    return np.array(base).astype(np.float32)


def step_percents(steps, denoise: float = 1.0, sigmas=None) -> list[float]:
    """How far through its schedule each step of `partial_schedule(..., steps, denoise, sigmas)` starts, 0 to 1:
    1 - its unshifted grid value (so for the released grid, the fraction of the steps before it; a percent means the
    same at every size and shift)."""
    if denoise >= 1.0 or sigmas is not None:
        if sigmas is not None and denoise < 1.0:
            sigmas = list(sigmas)[-max(1, round(len(sigmas) * denoise)) :]
        grid = _base_grid(steps, sigmas)
    else:
        grid = _base_grid(int(steps / denoise), None)[-steps:]
    return [1.0 - float(value) for value in grid]


def partial_schedule(config, image_seq_len, steps, denoise, sigmas=None):
    """KSampler-style denoise < 1: the last `steps` sigmas of a schedule of int(steps / denoise) steps."""
    if not 0.0 < denoise <= 1.0:
        raise ValueError(f"denoise must be in (0, 1], got {denoise}")
    if sigmas is not None and len(sigmas) > MAX_STEPS:
        raise ValueError(f"{len(sigmas)} sigmas given; at most {MAX_STEPS} steps run (the Sampler node's maximum)")
    if sigmas is None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS):
        raise ValueError(f"steps must be from 1 to {MAX_STEPS}: at most {MAX_STEPS} steps run (the Sampler node's "
                         f"maximum), got {steps!r:.40}")  # fmt: skip
    if sigmas is None and denoise < 1.0 and steps / denoise > MAX_GRID_STEPS:
        raise ValueError(f"denoise {denoise} with {steps} steps takes them from a schedule of {int(steps / denoise)} "
                         f"steps; at most {MAX_GRID_STEPS}: raise denoise (0.01 or more)")  # fmt: skip
    if denoise >= 1.0 or sigmas is not None:
        if sigmas is not None and denoise < 1.0:
            count = max(1, round(len(sigmas) * denoise))
            sigmas = list(sigmas)[-count:]
        return flow_schedule(config, image_seq_len, steps=steps, sigmas=sigmas)
    total = int(steps / denoise)
    full_sigmas, full_timesteps = flow_schedule(config, image_seq_len, steps=total)
    return full_sigmas[-(steps + 1) :], full_timesteps[-steps:]


def euler_step(x: torch.Tensor, velocity: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor):
    """x + (sigma_next - sigma) * v with the reference's rounding: dt is a 0-dim fp32 tensor, so dt * v
    stays in v's dtype; the sum is fp32 and the result is cast back to v's dtype."""
    dt = sigma_next - sigma
    return (x.to(torch.float32) + dt * velocity).to(velocity.dtype)
