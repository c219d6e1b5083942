"""Per-row activation quantisation for W8A8 GEMMs, fused with the op that produces the activation.

    q, scale = quantize_rows(x, "fp8" | "int8", rotation=0 | 4 | 16 | 64 | 256 | 1024, layer_norm=..., swiglu=...,
                             dequant=...)

One pass over the activation computes what feeds a quantised Linear and quantises it, so the bf16 activation
is never written and read back (an unfused quantisation pass costs about what FP8 saves in the GEMM):

- pre-op (optional): `layer_norm=LayerNormModulation(mod, rows_per_batch, eps)`: LayerNorm without affine,
  times (1 + scale) of the row's batch (the block's modulated norms); or `swiglu=True`: x is [M, 2K] = [gate |
  up], the activation is silu(gate) * up (the MLP's down-projection input). `dequant=(row_scale, col_scale)`
  first turns an int32 GEMM accumulator into values (int8 W8A8 gate_up output -> SwiGLU);
- the activation is rounded to the activation dtype (bf16), as the unquantised path would feed its GEMM;
- rotation (optional): ConvRot, a normalised Hadamard rotation in groups of G along the row (comfy-kitchen's
  "regular" Hadamard: the Kronecker power of H4 = [[1,1,1,-1],[1,1,-1,1],[1,-1,1,1],[-1,1,1,1]], divided by
  sqrt(G), symmetric; defined for powers of 4 only, so G is 4, 16, 64, 256 (ComfyUI's default, the released
  files') or 1024). It spreads outliers over the group; the weights of int8_convrot files are stored rotated
  the same way. The kernel applies it as tensor-core dots at least 16 wide: a group of G = A * B values, read
  as an A x B tile Y, rotates to H_A . Y . H_B (H_G = H_A (x) H_B): G = 256 is H16 . Y . H16, 1024 is
  H64 . Y . H16, 64 one dot with H64, and 4 and 16 one dot with H16 or a 16x16 block-diagonal of H4s;
- scale = absmax(row) / QMAX (127 for int8, 448 for fp8 e4m3); q = value / scale, rounded to nearest even
  (int8, clamped to [-128, 127]) or cast to float8_e4m3fn (clamped to +-448).

`quantize_rows_reference` is the same arithmetic in torch (fp32, exact rotation). The kernel differs from it
only where the order of fp32 sums differs (the LayerNorm statistics, the rotation's tf32 dots): q can move
by one step on a small fraction of elements; scales agree to about 1e-6 relative (tests pin both).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import INTERPRETER_ACTIVE, TL_DTYPES, cdiv, jit, next_power_of_2, tl, triton_runs_on
from .launch import launch
from .launch_configs import LaunchConfig, TunedKernel, m_bucket

FORMATS = ("fp8", "int8")
QMAX = {"fp8": 448.0, "int8": 127.0}
STORAGE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
ROTATION_GROUP = 256  # ComfyUI's default ConvRot group: the released int8_convrot files', and our quantiser's
# Every group comfy-kitchen can write: its regular Hadamard is defined for powers of 4 only (it refuses 8, 32, 128).
# 4096 and up would need a 256-wide factor in the kernel and are not supported.
ROTATION_GROUPS = (4, 16, 64, 256, 1024)
MIN_SCALE = 1e-30  # a zero row quantises to zeros with this scale (no division by zero)
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Launch shape. Rows up to WHOLE_ROW_LIMIT wide are quantised in one pass, whole rows in registers (one read of
# the input); the rows per program and warps come from kernels/launch_configs.py (the tuned table, else `_rule`).
# Wider rows go in chunks of CHUNK_K, with the activation recomputed per pass.
WHOLE_ROW_LIMIT = 16384
CHUNK_M = 8
CHUNK_K = 256
INTERPRETER_SHAPE = (1, 4)  # (rows per program, warps) under the interpreter, where tuning means nothing
WHOLE_ROW_SHAPES = [(m, w) for m in (1, 2, 4) for w in (1, 2, 4, 8, 16)]


def _fits(block_m: int, warps: int, block_k: int) -> bool:
    """Between 8 and 128 fp32 values per thread: fewer wastes threads, more spills registers."""
    return 8 <= block_m * block_k // (32 * warps) <= 128


def _block_k(key: dict) -> int:
    return max(next_power_of_2(key["K"]), 256 if key["ROTATE"] else 16)


def _candidates(key: dict) -> list[LaunchConfig]:
    block_k = _block_k(key)
    shapes = [(m, w) for m, w in WHOLE_ROW_SHAPES if _fits(m, w, block_k)] or [(1, 16)]
    return [LaunchConfig.of(w, 3, BLOCK_M=m) for m, w in shapes]


def _rule(key: dict) -> LaunchConfig:
    """One row per program, 16 to 32 values per thread (the middle of `_fits`), at most 16 warps."""
    block_k = _block_k(key)
    warps = max(1, min(16, block_k // (32 * 16)))
    block_m = 1
    while not _fits(block_m, warps, block_k) and block_m < 4:
        block_m *= 2
    return LaunchConfig.of(warps, 3, BLOCK_M=block_m)


TUNED = TunedKernel("quantize_rows", ("K", "M_BUCKET", "PRE", "DEQUANT", "ROTATE", "OUT_INT8"), _rule, _candidates)


_PRE_NONE, _PRE_LAYER_NORM, _PRE_SWIGLU = 0, 1, 2


@dataclass(frozen=True)
class LayerNormModulation:
    """LayerNorm (no affine) of each row, times `mod` [B, K] of the row's batch (row // rows_per_batch)."""

    mod: torch.Tensor
    rows_per_batch: int
    eps: float


# ---------------------------------------------------------------------------------------------------------
# Rotation (torch) and the reference
# ---------------------------------------------------------------------------------------------------------

_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))
_hadamards: dict[tuple[int, str], torch.Tensor] = {}


def hadamard(size: int, device="cpu") -> torch.Tensor:
    """The normalised regular Hadamard matrix [size, size] (fp32, symmetric, orthogonal); size a power of 4.
    Its entries are +-1/sqrt(size), exact in fp32: the same matrix comfy-kitchen builds."""
    if size < 4 or size & (size - 1) or (size.bit_length() - 1) % 2:
        raise ValueError(f"Hadamard size must be a power of 4 (>= 4), got {size}")
    key = (size, str(device))
    if key not in _hadamards:
        h4 = torch.tensor(_H4, dtype=torch.float64)
        h = h4
        while h.shape[0] < size:
            h = torch.kron(h, h4)
        _hadamards[key] = (h / size**0.5).to(device=device, dtype=torch.float32)
    return _hadamards[key]


def _rotation_factors(group: int, device) -> tuple[int, torch.Tensor, int, torch.Tensor]:
    """(A, H_A, B, H_B): the group's rotation is H_A . Y . H_B on its A x B tile Y, each dot at least 16 wide.
    Groups under 16 ride in a 16-wide block-diagonal matrix (16 values hold 16 / group whole groups); A = 1 means
    one dot (H_A is then a placeholder the kernel does not read)."""
    if group <= 16:
        blocks = torch.kron(torch.eye(16 // group), hadamard(group))
        return 1, hadamard(16, device), 16, blocks.to(device)
    if group == 64:
        return 1, hadamard(16, device), 64, hadamard(64, device)
    return group // 16, hadamard(group // 16, device), 16, hadamard(16, device)


def rotate(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] rotated in groups of `group` along the last dim (x_group @ H); fp32 in, fp32 out."""
    shape = x.shape
    return (x.reshape(-1, shape[-1] // group, group) @ hadamard(group, x.device)).reshape(shape)


def _activation(x, act_dtype, layer_norm, swiglu, dequant) -> torch.Tensor:
    v = x.float()
    if dequant is not None:
        row_scale, col_scale = dequant
        v = v * row_scale.float()[:, None] * col_scale.float()[None, :]
    if swiglu:
        gate, up = v.chunk(2, dim=-1)
        v = gate / (1 + torch.exp(-gate)) * up
    if layer_norm is not None:
        mean = v.mean(-1, keepdim=True)
        var = ((v * v).mean(-1, keepdim=True) - mean * mean).clamp(min=0)
        rows = torch.arange(v.shape[0], device=v.device) // layer_norm.rows_per_batch
        v = (v - mean) * torch.rsqrt(var + layer_norm.eps) * layer_norm.mod.float()[rows]
    return v.to(act_dtype).float()


def quantize_rows_reference(
    x: torch.Tensor,
    fmt: str,
    rotation: int = 0,
    *,
    layer_norm: LayerNormModulation | None = None,
    swiglu: bool = False,
    dequant: tuple[torch.Tensor, torch.Tensor] | None = None,
    act_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch formulation: (q [M, K] in STORAGE[fmt], scale [M] fp32). Arguments as `quantize_rows`."""
    act_dtype = act_dtype or (x.dtype if x.is_floating_point() else torch.bfloat16)
    y = _activation(x, act_dtype, layer_norm, swiglu, dequant)
    if rotation:
        y = rotate(y, rotation)
    scale = y.abs().amax(dim=-1).clamp(min=MIN_SCALE) / QMAX[fmt]
    values = y / scale[:, None]
    if fmt == "int8":
        return values.round().clamp(-128, 127).to(torch.int8), scale
    return values.clamp(-QMAX["fp8"], QMAX["fp8"]).to(torch.float8_e4m3fn), scale


# ---------------------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------------------


@jit
def _load_raw(x_ptr, x_stride, rows, row_mask, cols, K, row_scale, col_scale_ptr, DEQUANT: tl.constexpr,
              UP: tl.constexpr):  # fmt: skip
    """Input values at [rows, cols] (the up half of the row with UP), dequantised, fp32; 0 where masked."""
    col_mask = cols < K
    offset = K if UP else 0
    mask = row_mask[:, None] & col_mask[None, :]
    v = tl.load(x_ptr + rows[:, None] * x_stride + offset + cols[None, :], mask=mask, other=0).to(tl.float32)
    if DEQUANT:
        v = v * row_scale[:, None] * tl.load(col_scale_ptr + offset + cols, mask=col_mask, other=0.0)[None, :]
    return v


@jit
def _pre_op(v, up, rows, row_mask, cols, K, mod_ptr, mod_stride, batch, mean, rstd, PRE: tl.constexpr,
            ACT_DTYPE: tl.constexpr):  # fmt: skip
    """The activation from the input values (SwiGLU, or modulated LayerNorm), rounded to the activation dtype."""
    if PRE == 2:
        v = v / (1 + tl.exp(-v)) * up
    if PRE == 1:
        mask = row_mask[:, None] & (cols < K)[None, :]
        mod = tl.load(mod_ptr + batch[:, None] * mod_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = (v - mean[:, None]) * rstd[:, None] * mod
    return v.to(ACT_DTYPE).to(tl.float32)


@jit
def _activation_chunk(x_ptr, x_stride, rows, row_mask, cols, K, row_scale, col_scale_ptr, mod_ptr, mod_stride, batch,
                mean, rstd, PRE: tl.constexpr, DEQUANT: tl.constexpr, ACT_DTYPE: tl.constexpr):  # fmt: skip
    v = _load_raw(x_ptr, x_stride, rows, row_mask, cols, K, row_scale, col_scale_ptr, DEQUANT, False)
    up = v
    if PRE == 2:
        up = _load_raw(x_ptr, x_stride, rows, row_mask, cols, K, row_scale, col_scale_ptr, DEQUANT, True)
    return _pre_op(v, up, rows, row_mask, cols, K, mod_ptr, mod_stride, batch, mean, rstd, PRE, ACT_DTYPE)


@jit
def _rotate_tiles(y, ha, hb, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr):
    """y [BLOCK_M, BLOCK_K] -> each group (ROT_A * ROT_B values) of each row rotated, as H_A . Y . H_B on its
    ROT_A x ROT_B tile (only Y . H_B when ROT_A is 1).

    tf32 dots: the first takes bf16-representable values (exact in tf32); the second rounds the fp32 intermediate
    to tf32 (2^-11 relative), far below a quantisation step (bench_quant: the same per-Linear error as the exact
    fp32 rotation), at a third of 3xTF32's cost.
    """
    t = tl.dot(tl.reshape(y, (BLOCK_M * BLOCK_K // ROT_B, ROT_B)), hb, input_precision="tf32")  # Y H_B per tile
    if ROT_A > 1:
        t = tl.reshape(
            tl.permute(tl.reshape(t, (BLOCK_M * BLOCK_K // (ROT_A * ROT_B), ROT_A, ROT_B)), (0, 2, 1)),
            (BLOCK_M * BLOCK_K // ROT_A, ROT_A),
        )
        t = tl.dot(t, ha, input_precision="tf32")  # (Y H_B)^T H_A = (H_A Y H_B)^T
        t = tl.permute(tl.reshape(t, (BLOCK_M * BLOCK_K // (ROT_A * ROT_B), ROT_B, ROT_A)), (0, 2, 1))
    return tl.reshape(t, (BLOCK_M, BLOCK_K))


@jit
def _store_quantized(q_ptr, q_stride, rows, row_mask, cols, K, y, scale, OUT_INT8: tl.constexpr, QMAX: tl.constexpr):
    values = tl.math.div_rn(y, scale[:, None])  # IEEE division, as torch's: the same values round the same way
    mask = row_mask[:, None] & (cols < K)[None, :]
    destination = q_ptr + rows[:, None] * q_stride + cols[None, :]
    if OUT_INT8:
        rounded = _round_half_even(values)
        tl.store(destination, tl.minimum(tl.maximum(rounded, -128.0), 127.0).to(tl.int8), mask=mask)
    else:
        tl.store(destination, tl.minimum(tl.maximum(values, -QMAX), QMAX).to(tl.float8e4nv), mask=mask)


# M, M_BUCKET and rows_per_batch change with the prompt: not specialised on (see _triton.jit)
@jit(do_not_specialize=("M", "M_BUCKET", "rows_per_batch"))
def _quantize_rows_kernel(
    x_ptr, x_stride, row_scale_ptr, col_scale_ptr, mod_ptr, mod_stride, rows_per_batch, ha_ptr, hb_ptr,
    q_ptr, q_stride, scale_ptr, M, K, M_BUCKET, inv_k, eps,
    PRE: tl.constexpr, DEQUANT: tl.constexpr, ROTATE: tl.constexpr, ROT_A: tl.constexpr, ROT_B: tl.constexpr,
    OUT_INT8: tl.constexpr,
    QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, ACT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, WHOLE_ROW: tl.constexpr,
):  # fmt: skip
    # One program quantises BLOCK_M rows. WHOLE_ROW: the row is read once and everything (statistics, pre-op,
    # rotation, absmax, quantisation) happens in registers. Otherwise each pass (statistics for the LayerNorm,
    # absmax, quantise) walks the row in BLOCK_K chunks and recomputes the activation (re-reads hit the caches).
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    chunk = tl.arange(0, BLOCK_K)
    batch = rows // rows_per_batch
    row_scale = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if DEQUANT:
        row_scale = tl.load(row_scale_ptr + rows, mask=row_mask, other=0.0)
    ha = tl.zeros((ROT_A, ROT_A), dtype=tl.float32)
    hb = tl.zeros((ROT_B, ROT_B), dtype=tl.float32)
    if ROTATE:
        hb = tl.load(hb_ptr + tl.arange(0, ROT_B)[:, None] * ROT_B + tl.arange(0, ROT_B)[None, :])
        if ROT_A > 1:
            ha = tl.load(ha_ptr + tl.arange(0, ROT_A)[:, None] * ROT_A + tl.arange(0, ROT_A)[None, :])
    mean = tl.zeros((BLOCK_M,), dtype=tl.float32)
    rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)

    if WHOLE_ROW:
        v = _load_raw(x_ptr, x_stride, rows, row_mask, chunk, K, row_scale, col_scale_ptr, DEQUANT, False)
        up = v
        if PRE == 2:
            up = _load_raw(x_ptr, x_stride, rows, row_mask, chunk, K, row_scale, col_scale_ptr, DEQUANT, True)
        if PRE == 1:
            mean = tl.sum(v, axis=1) * inv_k
            rstd = tl.math.rsqrt(tl.maximum(tl.sum(v * v, axis=1) * inv_k - mean * mean, 0.0) + eps)
        y = _pre_op(v, up, rows, row_mask, chunk, K, mod_ptr, mod_stride, batch, mean, rstd, PRE, ACT_DTYPE)
        if ROTATE:
            y = _rotate_tiles(y, ha, hb, BLOCK_M, BLOCK_K, ROT_A, ROT_B)
        scale = tl.maximum(tl.max(tl.abs(y), axis=1), MIN_SCALE) / QMAX
        tl.store(scale_ptr + rows, scale, mask=row_mask)
        _store_quantized(q_ptr, q_stride, rows, row_mask, chunk, K, y, scale, OUT_INT8, QMAX)
    else:
        if PRE == 1:
            total = tl.zeros((BLOCK_M,), dtype=tl.float32)
            squares = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for start in range(0, K, BLOCK_K):
                v = _load_raw(x_ptr, x_stride, rows, row_mask, start + chunk, K, row_scale, col_scale_ptr, DEQUANT,
                              False)  # fmt: skip
                total += tl.sum(v, axis=1)
                squares += tl.sum(v * v, axis=1)
            mean = total * inv_k
            rstd = tl.math.rsqrt(tl.maximum(squares * inv_k - mean * mean, 0.0) + eps)
        absmax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            y = _activation_chunk(x_ptr, x_stride, rows, row_mask, start + chunk, K, row_scale, col_scale_ptr, mod_ptr,
                            mod_stride, batch, mean, rstd, PRE, DEQUANT, ACT_DTYPE)  # fmt: skip
            if ROTATE:
                y = _rotate_tiles(y, ha, hb, BLOCK_M, BLOCK_K, ROT_A, ROT_B)
            absmax = tl.maximum(absmax, tl.max(tl.abs(y), axis=1))
        scale = tl.maximum(absmax, MIN_SCALE) / QMAX
        tl.store(scale_ptr + rows, scale, mask=row_mask)
        for start in range(0, K, BLOCK_K):
            y = _activation_chunk(x_ptr, x_stride, rows, row_mask, start + chunk, K, row_scale, col_scale_ptr, mod_ptr,
                            mod_stride, batch, mean, rstd, PRE, DEQUANT, ACT_DTYPE)  # fmt: skip
            if ROTATE:
                y = _rotate_tiles(y, ha, hb, BLOCK_M, BLOCK_K, ROT_A, ROT_B)
            _store_quantized(q_ptr, q_stride, rows, row_mask, start + chunk, K, y, scale, OUT_INT8, QMAX)


@jit
def _round_half_even(v):
    # torch.round's rounding, from floor (exact in fp32 for |v| < 2^23; the interpreter has no libdevice rint)
    floor = tl.floor(v)
    diff = v - floor
    up = (diff > 0.5) | ((diff == 0.5) & (floor - 2 * tl.floor(floor * 0.5) != 0))
    return tl.where(up, floor + 1, floor)


def _unsupported(x, fmt, rotation, layer_norm, swiglu, dequant, act_dtype) -> str | None:
    if fmt not in FORMATS:
        return f"fmt must be one of {FORMATS}, got {fmt!r}"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.stride(1) != 1:
        return f"x must be a 2-D tensor with contiguous rows, got {getattr(x, 'shape', type(x).__name__)}"
    if dequant is None and x.dtype not in _ACT_DTYPES:
        return f"x must be one of {_ACT_DTYPES} (or int32 with dequant=...), got {x.dtype}"
    if dequant is not None and (x.dtype != torch.int32 or len(dequant) != 2):
        return f"dequant=(row_scale, col_scale) needs an int32 accumulator, got x {x.dtype}"
    if act_dtype not in _ACT_DTYPES:
        return f"act_dtype must be one of {_ACT_DTYPES}, got {act_dtype}"
    if layer_norm is not None and swiglu:
        return "layer_norm and swiglu cannot be combined"
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    if swiglu and x.shape[1] % 2:
        return f"swiglu needs [gate | up] rows of even width, got {x.shape[1]}"
    if rotation not in (0, *ROTATION_GROUPS):
        return f"rotation must be 0 (none) or a ConvRot group of {ROTATION_GROUPS}, got {rotation}"
    if rotation and k % rotation:
        return f"rotation groups of {rotation} need a row width that is a multiple of it, got {k}"
    if dequant is not None:
        row_scale, col_scale = dequant
        if row_scale.shape != (x.shape[0],) or col_scale.shape != (x.shape[1],):
            return f"dequant scales must be [M]={x.shape[0]} and [N]={x.shape[1]} fp32, got " + (
                f"{tuple(row_scale.shape)} and {tuple(col_scale.shape)}"
            )
    if layer_norm is not None:
        mod = layer_norm.mod
        if mod.dim() != 2 or mod.shape[1] != k or mod.stride(1) != 1:
            return f"layer_norm.mod must be [B, {k}] with contiguous rows, got {tuple(mod.shape)}"
        if layer_norm.rows_per_batch < 1 or mod.shape[0] * layer_norm.rows_per_batch < x.shape[0]:
            per = layer_norm.rows_per_batch
            return f"layer_norm.mod has {mod.shape[0]} batch rows for {x.shape[0]} rows at {per} each"
    return None


def quantize_rows(
    x: torch.Tensor,
    fmt: str,
    rotation: int = 0,
    *,
    layer_norm: LayerNormModulation | None = None,
    swiglu: bool = False,
    dequant: tuple[torch.Tensor, torch.Tensor] | None = None,
    act_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise the activation derived from x, per row.

    x:          [M, K] activation ([M, 2K] with swiglu), rows contiguous; int32 with `dequant`.
    fmt:        "fp8" (float8_e4m3fn) or "int8".
    rotation:   0, or the ConvRot group (one of ROTATION_GROUPS; K must be a multiple of it).
    layer_norm: LayerNorm + modulation before quantising (see LayerNormModulation).
    swiglu:     x is [gate | up]: quantise silu(gate) * up.
    dequant:    (row_scale [M], col_scale [N]) fp32: x is an int32 accumulator, value = x * row * col.
    act_dtype:  the dtype the activation is rounded to before quantising (default x's dtype, bf16 for int32).
    Returns (q [M, K] float8_e4m3fn or int8, scale [M] fp32): activation ~= q * scale[:, None] (rotated).
    The Triton kernel runs where Triton runs on x's device; elsewhere the torch reference.
    """
    act_dtype = act_dtype or (x.dtype if x.is_floating_point() else torch.bfloat16)
    reason = _unsupported(x, fmt, rotation, layer_norm, swiglu, dequant, act_dtype)
    if reason:
        raise ValueError(f"quantize_rows: {reason}")
    if not triton_runs_on(x.device) or x.numel() == 0:
        return quantize_rows_reference(
            x, fmt, rotation, layer_norm=layer_norm, swiglu=swiglu, dequant=dequant, act_dtype=act_dtype
        )
    m = x.shape[0]
    k = x.shape[1] // 2 if swiglu else x.shape[1]
    q = torch.empty((m, k), dtype=STORAGE[fmt], device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    row_scale, col_scale = dequant if dequant is not None else (scale, scale)
    mod, rows_per_batch, eps = (layer_norm.mod, layer_norm.rows_per_batch, layer_norm.eps) if layer_norm else (
        x, 1, 0.0)  # fmt: skip
    pre = _PRE_LAYER_NORM if layer_norm is not None else _PRE_SWIGLU if swiglu else _PRE_NONE
    rot_a, ha, rot_b, hb = _rotation_factors(rotation, x.device) if rotation else (1, scale, 16, scale)
    # a row block holds whole groups and gives each rotation dot at least 16 rows (256 for groups up to 256)
    block_k = max(next_power_of_2(k), 16 * rot_b if rotation else 16)
    whole_row = block_k <= WHOLE_ROW_LIMIT
    bucket = m_bucket(m)
    args = (x, x.stride(0), row_scale, col_scale, mod, mod.stride(0), rows_per_batch, ha, hb, q, q.stride(0), scale, m,
            k, bucket, 1.0 / k, float(eps))  # fmt: skip
    modes = _modes(pre, dequant is not None, rotation, rot_a, rot_b, fmt, act_dtype)
    if not whole_row:
        chunk_k = max(CHUNK_K, rotation)  # whole groups per chunk
        launch(_quantize_rows_kernel, (cdiv(m, CHUNK_M),), *args, **modes, BLOCK_M=CHUNK_M, BLOCK_K=chunk_k,
               WHOLE_ROW=False, num_warps=4)  # fmt: skip
    elif INTERPRETER_ACTIVE:
        block_m, warps = INTERPRETER_SHAPE
        _quantize_rows_kernel[(cdiv(m, block_m),)](*args, **modes, BLOCK_M=block_m, BLOCK_K=block_k,
                                                   WHOLE_ROW=True, num_warps=warps)  # fmt: skip
    else:
        key = {"K": k, "M_BUCKET": bucket, "PRE": pre, "DEQUANT": dequant is not None, "ROTATE": bool(rotation),
               "OUT_INT8": fmt == "int8"}  # fmt: skip
        TUNED.launch(_quantize_rows_kernel, lambda config: (cdiv(m, config.meta_dict()["BLOCK_M"]),), args,
                     {**modes, "BLOCK_K": block_k, "WHOLE_ROW": True}, key, x.device)  # fmt: skip
    return q, scale


_modes_cache: dict[tuple, dict] = {}


def _modes(pre: int, dequant: bool, rotation: int, rot_a: int, rot_b: int, fmt: str, act_dtype) -> dict:
    """The kernel's mode constexprs, one dict per combination built once (read at every launch, never changed)."""
    key = (pre, dequant, rotation, rot_a, rot_b, fmt, act_dtype)
    modes = _modes_cache.get(key)
    if modes is None:
        modes = _modes_cache[key] = dict(PRE=pre, DEQUANT=dequant, ROTATE=bool(rotation), ROT_A=rot_a, ROT_B=rot_b,
                                         OUT_INT8=fmt == "int8", QMAX=QMAX[fmt], MIN_SCALE=MIN_SCALE,
                                         ACT_DTYPE=TL_DTYPES[act_dtype])  # fmt: skip
    return modes
