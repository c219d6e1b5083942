"""Velocities for a sampling loop that is not ours: ComfyUI's KSampler, its samplers and custom sampling nodes.

Such a loop asks, call after call, for the velocity of a batch of latents whose rows belong to one or more
conditionings (ComfyUI runs a conditioning's rows together and may batch the positive and the negative into one
call). A `VelocityRun` lives for one sampling run and keeps, per conditioning, role, size and row count, one branch:
its prefix K/V are computed at its first call (or found in a kept decode-graph entry from an earlier run with the same
prefix) and every later call decodes only the target tokens, replayed from a CUDA graph where the pipeline's decode
graphs capture one. The math per call is our sampler's (`Sampler`): same layouts, prefill, decode and timestep
rounding.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .conditioning import Conditioning
from .dit.transformer import Branch
from .sampler import Sampler, condition_tokens, model_timestep, pack, unpack

ROLES = ("positive", "negative")


@dataclass(frozen=True)
class Part:
    """`rows` consecutive rows of a call's batch, conditioned on `cond` (its positive prompt). `role` says which CFG
    side they are ("positive" or "negative"): it keys the kept decode graphs and the prefix, not the math."""

    cond: Conditioning
    role: str
    rows: int

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"a part's role must be one of {ROLES}, got {self.role!r}")
        if self.rows < 1:
            raise ValueError(f"a part needs at least one row, got {self.rows}")


@dataclass
class _Kept:
    branch: Branch
    tokens: torch.Tensor | None
    prefix_id: object
    prefilled: bool = False


@dataclass
class VelocityRun:
    """One sampling run's branches. `velocity` per call; `close` once at the end (releases the branches, keeps the
    decode-graph entries for the next run, fills the sampler's stats)."""

    sampler: Sampler
    on_close: Callable[[Sampler], None] | None = None  # the pipeline's: stats kept, graph entries idle
    kept: dict = field(default_factory=dict)
    calls: int = 0
    controlled_calls: int = 0
    strength: float | None = None  # of the control the controlled calls ran
    closed: bool = False
    _started: float = field(default_factory=time.perf_counter)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, parts: list[Part], control=None,
                 context: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x: [B, C, h, w] latents normalised as the DiT sees them; sigma: [B] (or one value); parts: the rows' owners
        in order, their rows adding up to B. control, context: a Fun-Control (control.py Control) on for this call,
        with its [h * w, 129] context: every part runs a controlled branch. Returns the velocity [B, C, h, w] in
        float32."""
        if self.closed:
            raise RuntimeError("this velocity run is closed; open a new one for the next sampling run")
        tr = self.sampler.transformer
        if x.dim() != 4 or x.shape[1] != tr.config.in_channels:
            raise ValueError(f"latents must be [B, {tr.config.in_channels}, h, w], got {list(x.shape)}")
        if sum(part.rows for part in parts) != x.shape[0]:
            raise ValueError(f"the parts cover {sum(p.rows for p in parts)} rows but the batch has {x.shape[0]}")
        h, w = x.shape[-2:]
        sigma = sigma.reshape(-1).to(torch.float32).expand(x.shape[0]) if sigma.numel() == 1 else sigma.reshape(-1)
        device, dtype = tr.device, tr.dtype
        out, start = [], 0
        for part in parts:
            rows = slice(start, start + part.rows)
            start += part.rows
            kept = self._kept(part, (h, w), control, context)
            if not kept.prefilled:
                with torch.profiler.record_function("qwen21 prefill"):
                    self.sampler._prefill(kept.branch, part.cond.positive, kept.tokens,
                                          kept.prefix_id if self.sampler.prefix_cache else None)  # fmt: skip
                kept.prefilled = self.sampler.prefix_cache
            tokens = pack(x[rows].to(device)).to(dtype)
            t = model_timestep(sigma[rows].to(device), dtype)
            with torch.profiler.record_function("qwen21 step"):
                velocity = self.sampler._velocity(kept.branch, tokens, t)
            out.append(unpack(velocity.float(), h, w))
        self.calls += 1
        if control is not None:
            self.controlled_calls += 1
            self.strength = float(control.strength)
        return torch.cat(out)

    def _kept(self, part: Part, target_shape, control=None, context=None) -> _Kept:
        controlled = None if control is None else (control.prefix_key, control.identity)
        key = (id(part.cond), part.role, tuple(target_shape), part.rows, controlled)
        kept = self.kept.get(key)
        if kept is None:
            started = time.perf_counter()
            cond = part.cond
            branch = self.sampler.new_branch(cond, cond.positive, part.role, target_shape, part.rows, control, context)
            kept = _Kept(branch, condition_tokens(cond), self.sampler.prefix_id(cond, part.role, control))
            stats = self.sampler.stats
            stats.branch_setup_s += time.perf_counter() - started
            stats.cache_bytes += branch.cache_bytes
            stats.cache_host_bytes += branch.cache_host_bytes
            self.kept[key] = kept
        return kept

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for kept in self.kept.values():
            self.sampler.release_branch(kept.branch)
        stats = self.sampler.stats
        stats.steps = self.calls
        stats.seconds = time.perf_counter() - self._started
        if self.controlled_calls:
            stats.control = f"{self.controlled_calls}/{self.calls} calls at strength {self.strength:g}"
        tr = self.sampler.transformer
        if tr.device.type == "cuda":
            stats.peak_vram_bytes = torch.cuda.max_memory_allocated(tr.device)
        if self.kept:
            first = next(iter(self.kept.values()))
            stats.kv_cache = self.sampler.kv.describe(tr.dtype, tr.device) if first.branch.cache is not None else ""
        self.kept.clear()
        if self.on_close is not None:
            self.on_close(self.sampler)
