"""Memory-aware tiling for VAE decode and encode: plan, overlapping tiles with blending, OOM retry.

Plan ("auto"): an untiled pass runs when its estimated memory fits in what the device may use (on CUDA the
driver-free memory plus what torch's allocator holds unused; on the CPU the available RAM, at most
HOST_PASS_BYTES; times a safety margin); a batch that does not fit whole is split into the largest
sub-batches that do. Only when one image does not fit is it tiled, with the largest tile that fits. "on"
always tiles (tile_size or TilingConfig.tile_size); "off" never does. Tiles are processed one image at a time.

The estimate is bytes per pixel (output pixels for decode, input pixels for encode) times pixels, from the
constants below, scaled by the model's width against the full-size VAE (activations grow with channels).
Only activations count: the weights are already resident.

Tiles: square tiles of `tile` latent pixels, spread evenly so that neighbours overlap by at least
`overlap * tile` (all tiles have the same size; the overlap grows to fill the image). Each output tile is
weighted by a separable ramp that rises linearly across its overlap with each neighbour (1 in its interior)
and the weighted sum is divided by the summed weights: a convex combination of the overlapping tiles, so
no seam. The VAE's mid-block attention sees only its tile, so tiled results differ slightly from untiled.

OOM: a CUDA out-of-memory error while tiling halves the tile (the overlap ratio stays), down to
`min_tile_size`; the error is re-raised as VAEOutOfMemoryError, with advice, only when even that fails.
Under "auto", an untiled pass that runs out of memory falls back to tiling. Nothing is mutated: the
TilingConfig the caller passed is the same afterwards, success or failure. `callback(done, total)` runs
after every tile (after every sub-batch when untiled) and may raise to interrupt.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..errors import stable_name
from ..memory.planner import device_free_bytes, host_free_bytes

log = logging.getLogger(__name__)

LATENT_SCALE = 16  # pixels per latent pixel along each axis

# Peak activation bytes per pixel of ONE image for an untiled pass (decode: output pixels; encode: input
# pixels), by (kind, quality, bytes per activation element). Measured with
# `python benchmarks/bench_vae.py --measure-memory --sizes 512 1024` (full-size random weights): the slope of
# torch.cuda.max_memory_allocated between 512^2 and 1024^2, plus 10% (cuDNN workspaces, allocator rounding).
BYTES_PER_PIXEL = {
    ("decode", "exact", 2): 3010,
    ("decode", "exact", 4): 6030,
    ("decode", "fast", 2): 1901,
    ("decode", "fast", 4): 3803,
    ("encode", "exact", 2): 1488,
    ("encode", "exact", 4): 2554,
}
SAFETY = 0.85  # plan to use at most this fraction of the free memory
# On the CPU a pass may plan at most this much RAM: enough for an untiled full-size 1024^2 decode in bf16, while a
# large decode tiles instead of growing the process (and a ComfyUI server) by many GB that the allocator keeps.
HOST_PASS_BYTES = 4 * 2**30


@dataclass(frozen=True)
class TilingConfig:
    """Tiling defaults. tile_size and min_tile_size in pixels (multiples of 16); overlap: the fraction of a
    tile shared with each neighbour (at least; 0 < overlap <= 0.5)."""

    tile_size: int = 512
    overlap: float = 0.25
    min_tile_size: int = 128

    def __post_init__(self):
        check_tile_size(self.tile_size, "tile_size")
        check_tile_size(self.min_tile_size, "min_tile_size")
        if not 0.0 < self.overlap <= 0.5:
            raise ValueError(f"TilingConfig.overlap must be in (0, 0.5], got {self.overlap}")


@stable_name
class VAEOutOfMemoryError(torch.OutOfMemoryError):
    """The VAE ran out of GPU memory in every configuration it was allowed to try."""


def check_tile_size(tile_size, what: str = "tile_size") -> int:
    if isinstance(tile_size, bool) or not isinstance(tile_size, int) or tile_size < 2 * LATENT_SCALE:
        raise ValueError(f"{what} must be an int >= {2 * LATENT_SCALE} pixels, got {tile_size!r}")
    if tile_size % LATENT_SCALE:
        raise ValueError(
            f"{what} must be a multiple of {LATENT_SCALE} pixels, got {tile_size}; "
            f"e.g. {tile_size // LATENT_SCALE * LATENT_SCALE}"
        )
    return tile_size


# ---------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------


def bytes_per_pixel(kind: str, quality: str, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return BYTES_PER_PIXEL[(kind, quality if kind == "decode" else "exact", 4 if element >= 4 else 2)]


class _LiveTensors(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[int, list]] = {}  # storage id -> (bytes, weak refs of its tensors)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                size, refs = self.storages.get(storage._cdata, (0, []))
                self.storages[storage._cdata] = (max(size, storage.nbytes()), [*refs, weakref.ref(t)])
        live = 0
        for key, (size, refs) in list(self.storages.items()):
            refs = [r for r in refs if r() is not None]
            if refs:
                self.storages[key] = (size, refs)
                live += size
            else:
                del self.storages[key]
        self.peak = max(self.peak, live)  # after each op: its inputs and outputs are alive together
        return out


def untiled_bytes(kind: str, quality: str, dtype: torch.dtype, images: int, height: int, width: int,
                  activation_scale: float = 1.0) -> int:  # fmt: skip
    """Free memory an untiled pass over `images` images of height x width output (decode) or input (encode) pixels
    plans with: its peak activations (BYTES_PER_PIXEL) over SAFETY, what `run` compares with the free memory."""
    return int(bytes_per_pixel(kind, quality, dtype) * activation_scale * images * height * width / SAFETY)


def live_tensor_peak(fn: Callable[[], object]) -> int:
    """Peak bytes of tensors created by fn that were alive at the same time (device-independent, so it runs
    on the meta device for full-size models). How the first BYTES_PER_PIXEL estimates were derived; it
    misses cuDNN workspaces and allocator rounding, hence their margin."""
    with torch.no_grad(), _LiveTensors() as live:
        fn()
    return live.peak


def available_bytes(device: torch.device) -> int:
    """Memory a pass may plan to use on `device`. CUDA: the planner's free memory, which also honours a
    per-process cap (without it, a decode at a 16 GB cap tried untiled, ran out of memory and only then tiled).
    Elsewhere: the RAM the OS calls available, at most HOST_PASS_BYTES."""
    if device.type == "cuda":
        return int(device_free_bytes(device) * SAFETY)
    host = host_free_bytes()
    return int(min(HOST_PASS_BYTES, HOST_PASS_BYTES if host is None else host) * SAFETY)


# ---------------------------------------------------------------------------------------------------------
# Tiles and blending
# ---------------------------------------------------------------------------------------------------------


def tile_starts(length: int, tile: int, overlap: int) -> list[int]:
    """Starts of equal tiles covering [0, length) with neighbours overlapping by at least `overlap`."""
    if length <= tile:
        return [0]
    count = math.ceil((length - overlap) / (tile - overlap))
    return [round(i * (length - tile) / (count - 1)) for i in range(count)]


def _ramps(starts: list[int], tile: int, length: int, scale: int, device) -> list[torch.Tensor]:
    """Per tile, its 1-D blend weights in output units: linear over each overlap with a neighbour."""
    size = min(tile, length) * scale
    position = torch.arange(size, device=device, dtype=torch.float32) + 0.5
    ramps = []
    for k, start in enumerate(starts):
        weight = torch.ones(size, device=device)
        if k > 0:  # rise across the overlap with the previous tile
            overlap = (starts[k - 1] + tile - start) * scale
            weight = torch.minimum(weight, position / overlap)
        if k + 1 < len(starts):  # fall across the overlap with the next tile
            overlap = (start + tile - starts[k + 1]) * scale
            weight = torch.minimum(weight, (size - position) / overlap)
        ramps.append(weight)
    return ramps


def _span(start: int, size: int, scale: int) -> slice:
    return slice(start * scale, (start + size) * scale)


def _run_tiled(fn, x, tile: int, overlap: int, in_scale: int, out_scale: int, callback) -> tuple[torch.Tensor, int]:
    """Blend fn over tiles of `tile` latent pixels, one image at a time. Returns (result fp32, tile count)."""
    batch, _, height, width = x.shape
    height, width = height // in_scale, width // in_scale  # in latent pixels
    rows, cols = tile_starts(height, tile, overlap), tile_starts(width, tile, overlap)
    row_ramps = _ramps(rows, tile, height, out_scale, x.device)
    col_ramps = _ramps(cols, tile, width, out_scale, x.device)
    th, tw = min(tile, height), min(tile, width)
    total = batch * len(rows) * len(cols)
    out = None
    done = 0
    for b in range(batch):
        for r, row in enumerate(rows):
            for c, col in enumerate(cols):
                piece = x[b : b + 1, :, _span(row, th, in_scale), _span(col, tw, in_scale)]
                y = fn(piece.contiguous())
                if out is None:
                    shape = (batch, y.shape[1], height * out_scale, width * out_scale)
                    out = torch.zeros(shape, device=y.device, dtype=torch.float32)
                weight = row_ramps[r][:, None] * col_ramps[c][None, :]
                out[b : b + 1, :, _span(row, th, out_scale), _span(col, tw, out_scale)].add_(y.float().mul_(weight))
                del y
                done += 1
                if callback is not None:
                    callback(done, total)
    # Divide by the summed weights (separable: rows x columns).
    row_sum = torch.zeros(height * out_scale, device=out.device)
    col_sum = torch.zeros(width * out_scale, device=out.device)
    for row, ramp in zip(rows, row_ramps, strict=True):
        row_sum[row * out_scale : row * out_scale + ramp.numel()] += ramp
    for col, ramp in zip(cols, col_ramps, strict=True):
        col_sum[col * out_scale : col * out_scale + ramp.numel()] += ramp
    out.div_(row_sum[:, None] * col_sum[None, :])
    return out, total


def _run_untiled(fn, x, batch_chunk: int, callback) -> torch.Tensor:
    batch = x.shape[0]
    chunks = range(0, batch, batch_chunk)
    if len(chunks) == 1:
        y = fn(x)
        if callback is not None:
            callback(1, 1)
        return y
    out = None
    for k, start in enumerate(chunks):
        y = fn(x[start : start + batch_chunk])
        if out is None:
            out = y.new_empty((batch, *y.shape[1:]))
        out[start : start + y.shape[0]] = y
        del y
        if callback is not None:
            callback(k + 1, len(chunks))
    return out


# ---------------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    tiled: bool
    batch_chunk: int = 1  # images per untiled pass
    tile: int = 0  # latent pixels per tile side when tiled


def _plan(kind, mode, x, tile_size, config, quality, in_scale, activation_scale) -> _Plan:
    batch = x.shape[0]
    height, width = x.shape[2] // in_scale, x.shape[3] // in_scale
    default_tile = (tile_size or config.tile_size) // LATENT_SCALE
    if mode == "off":
        return _Plan(tiled=False, batch_chunk=batch)
    if mode == "on":
        return _Plan(tiled=True, tile=default_tile)
    free = available_bytes(x.device)
    per_pixel = bytes_per_pixel(kind, quality, x.dtype) * activation_scale * LATENT_SCALE**2  # per latent pixel
    fit = int(free // max(per_pixel * height * width, 1))
    if fit >= 1:
        return _Plan(tiled=False, batch_chunk=min(batch, fit))
    if tile_size:
        return _Plan(tiled=True, tile=default_tile)
    fitting = int(math.sqrt(free / per_pixel))
    return _Plan(tiled=True, tile=max(fitting, config.min_tile_size // LATENT_SCALE))


def run(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    kind: str,
    mode: str,
    tile_size: int | None,
    config: TilingConfig,
    quality: str,
    callback: Callable[[int, int], None] | None = None,
    activation_scale: float = 1.0,
) -> tuple[torch.Tensor, dict]:
    """Apply fn (one untiled decode or encode pass) to x, tiled or not, and return (result, info).

    kind: "decode" (x: latents; fn scales up 16x) or "encode" (x: pixels; fn scales down 16x).
    mode: "auto", "on" or "off"; tile_size: pixels (multiple of 16) or None for the default.
    activation_scale: the model's activation size against the full-size VAE's (its channel width ratio).
    info: {"tiled", "tiles", "tile_size" (px or None), "batch_chunk", "oom_retries"}.
    """
    if tile_size is not None:
        check_tile_size(tile_size)
    in_scale, out_scale = (1, LATENT_SCALE) if kind == "decode" else (LATENT_SCALE, 1)
    plan = _plan(kind, mode, x, tile_size, config, quality, in_scale, activation_scale)
    oom_retries = 0
    if not plan.tiled:
        failure = None
        try:
            y = _run_untiled(fn, x, plan.batch_chunk, callback)
            chunks = math.ceil(x.shape[0] / plan.batch_chunk)
            info = {"tiled": False, "tiles": chunks, "tile_size": None, "batch_chunk": plan.batch_chunk}
            return y, {**info, "oom_retries": 0}
        except torch.OutOfMemoryError as exc:
            failure = str(exc).splitlines()[0] if str(exc) else "out of memory"
        # Here the exception and the activations its traceback held are gone.
        _release_cached_memory(x.device)
        size = f"{x.shape[2] // in_scale * LATENT_SCALE}x{x.shape[3] // in_scale * LATENT_SCALE}"
        if mode == "off":
            raise VAEOutOfMemoryError(
                f"VAE {kind} of {x.shape[0]} image(s) at {size} ran out of GPU memory untiled ({failure}). "
                "Use tiling='auto' or 'on', a lower precision, or free GPU memory."
            )
        log.info("VAE %s at %s ran out of memory untiled; retrying tiled", kind, size)
        oom_retries = 1
        plan = _Plan(tiled=True, tile=(tile_size or config.tile_size) // LATENT_SCALE)

    floor = min(config.min_tile_size // LATENT_SCALE, plan.tile)
    tile = plan.tile
    tried = []
    while True:
        overlap = max(1, round(tile * config.overlap))
        tried.append(tile * LATENT_SCALE)
        failure = None
        try:
            y, tiles = _run_tiled(fn, x, tile, overlap, in_scale, out_scale, callback)
            info = {"tiled": True, "tiles": tiles, "tile_size": tile * LATENT_SCALE, "batch_chunk": 1}
            return y, {**info, "oom_retries": oom_retries}
        except torch.OutOfMemoryError as exc:
            failure = str(exc).splitlines()[0] if str(exc) else "out of memory"
        _release_cached_memory(x.device)
        if tile <= floor:
            raise VAEOutOfMemoryError(
                f"VAE {kind} ran out of GPU memory even with {tile * LATENT_SCALE}px tiles (tried {tried} px; "
                f"last error: {failure}). Free GPU memory (unload other models), use a lower precision "
                "('bf16' or 'fp16'), or process fewer images at once."
            )
        oom_retries += 1
        next_tile = max(floor, tile // 2)
        log.info("VAE %s: out of memory with %dpx tiles; retrying with %dpx", kind, tile * 16, next_tile * 16)
        tile = next_tile


def _release_cached_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
