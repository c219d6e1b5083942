"""What follows a low-precision GEMM, in one pass: dequantise and (optionally) add a gated residual.

    out = linear_epilogue(y, row_scale=..., col_scale=..., residual=x, gate=g, rows_per_batch=N)

- y is the GEMM's output [M, N]: an int32 accumulator of an int8 W8A8 GEMM (then `row_scale` [M] and
  `col_scale` [N] give value = y * row_scale * col_scale), or already dequantised bf16/fp16 (an FP8
  `_scaled_mm` applies its scales itself);
- with `bias` [N]: value + bias, rounded (a Linear's bias; the control branch's after_proj has one);
- with `residual` [M, N] and `gate` [B, N]: out = residual + gate[row's batch] * value (the block's gated
  residual, x + tanh(gate) * attn_out / mlp_out).

Numerics are the unfused torch sequence's: the dequantised value rounded to the output dtype (what a GEMM
with that output dtype returns), the product gate * value rounded, then the sum rounded. The kernel does those
fp32 operations in the same order, so it is bit-identical to `linear_epilogue_reference`.
"""

from __future__ import annotations

import torch

from ._triton import TL_DTYPES, cdiv, jit, tl, triton_runs_on
from .launch import launch

BLOCK_M = 16
BLOCK_N = 256
NUM_WARPS = 4
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear_epilogue_reference(y, *, row_scale=None, col_scale=None, bias=None, residual=None, gate=None,
                              rows_per_batch=1, out_dtype=None):  # fmt: skip
    """The torch formulation (see the module docstring)."""
    out_dtype = out_dtype or _default_out_dtype(y, residual)
    value = y
    if row_scale is not None:
        value = (y.float() * row_scale.float()[:, None] * col_scale.float()[None, :]).to(out_dtype)
    value = value.to(out_dtype)
    if bias is not None:
        value = (value.float() + bias.float()[None, :]).to(out_dtype)
    if residual is None:
        return value
    rows = torch.arange(y.shape[0], device=y.device) // rows_per_batch
    return residual + gate[rows] * value


def _default_out_dtype(y, residual) -> torch.dtype:
    if residual is not None:
        return residual.dtype
    return y.dtype if y.is_floating_point() else torch.bfloat16


@jit
def dequantize_tile(acc, rows, cols, row_mask, col_mask, row_scale_ptr, col_scale_ptr):
    """An int32 accumulator tile times its row and column scales, in fp32 (the reference's multiply order)."""
    row_scale = tl.load(row_scale_ptr + rows, mask=row_mask, other=0.0)
    col_scale = tl.load(col_scale_ptr + cols, mask=col_mask, other=0.0)
    return acc.to(tl.float32) * row_scale[:, None] * col_scale[None, :]


@jit
def add_gated_residual(value, rows, cols, mask, residual_ptr, residual_stride, gate_ptr, gate_stride, rows_per_batch,
                       OUT_DTYPE: tl.constexpr):  # fmt: skip
    """residual + gate[row's batch] * value for a tile (rows int64), rounded as the reference rounds."""
    batch = rows // rows_per_batch
    gate = tl.load(gate_ptr + batch[:, None] * gate_stride + cols[None, :], mask=mask, other=0.0)
    product = (gate.to(tl.float32) * value.to(tl.float32)).to(OUT_DTYPE)
    residual = tl.load(residual_ptr + rows[:, None] * residual_stride + cols[None, :], mask=mask, other=0.0)
    return (residual.to(tl.float32) + product.to(tl.float32)).to(OUT_DTYPE)


@jit(do_not_specialize=("M", "rows_per_batch"))  # row counts vary: one compile for all (_triton.jit)
def _linear_epilogue_kernel(
    y_ptr, y_stride, row_scale_ptr, col_scale_ptr, bias_ptr, residual_ptr, residual_stride, gate_ptr, gate_stride,
    rows_per_batch, out_ptr, out_stride, M, N,
    DEQUANT: tl.constexpr, BIAS: tl.constexpr, RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    value = tl.load(y_ptr + rows[:, None] * y_stride + cols[None, :], mask=mask, other=0)
    if DEQUANT:
        value = dequantize_tile(value, rows, cols, row_mask, col_mask, row_scale_ptr, col_scale_ptr)
    value = value.to(OUT_DTYPE)
    if BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0)
        value = (value.to(tl.float32) + bias.to(tl.float32)[None, :]).to(OUT_DTYPE)
    if RESIDUAL:
        value = add_gated_residual(value, rows, cols, mask, residual_ptr, residual_stride, gate_ptr, gate_stride,
                                   rows_per_batch, OUT_DTYPE)  # fmt: skip
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], value, mask=mask)


def _unsupported(y, row_scale, col_scale, bias, residual, gate, rows_per_batch, out_dtype) -> str | None:
    if y.dim() != 2 or y.stride(1) != 1:
        return f"y must be [M, N] with contiguous rows, got {tuple(y.shape)}"
    m, n = y.shape
    if (row_scale is None) != (col_scale is None):
        return "row_scale and col_scale go together"
    if row_scale is not None and (row_scale.shape != (m,) or col_scale.shape != (n,)):
        return f"scales must be [M]={m} and [N]={n}, got {tuple(row_scale.shape)} and {tuple(col_scale.shape)}"
    if row_scale is None and not y.is_floating_point():
        return f"an integer y ({y.dtype}) needs row_scale and col_scale"
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}"
    if bias is not None and (bias.shape != (n,) or bias.dtype != out_dtype or bias.stride(0) != 1):
        return f"bias must be [N]={n} contiguous {out_dtype}, got {bias.dtype} {tuple(bias.shape)}"
    return residual_problem(residual, gate, m, n, rows_per_batch, out_dtype)


def residual_problem(residual, gate, m: int, n: int, rows_per_batch: int, out_dtype) -> str | None:
    """Why (residual [M, N], gate [B, N]) cannot be an epilogue's gated residual, or None (shared with int8_gemm)."""
    if (residual is None) != (gate is None):
        return "residual and gate go together"
    if residual is None:
        return None
    if residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != out_dtype:
        got = f"{residual.dtype} {tuple(residual.shape)}"
        return f"residual must be [M, N] {out_dtype} with contiguous rows, got {got}"
    if gate.dim() != 2 or gate.shape[1] != n or gate.stride(1) != 1 or gate.shape[0] * rows_per_batch < m:
        return f"gate must be [B, {n}] covering {m} rows at {rows_per_batch} per batch, got {tuple(gate.shape)}"
    return None


def linear_epilogue(
    y: torch.Tensor,
    *,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    rows_per_batch: int = 1,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantise y (int32 with scales, or float), optionally add a bias, and optionally add residual + gate * value;
    see the module docstring. `out` may alias `residual` (each element is read before it is written). Returns
    [M, N]."""
    out_dtype = out_dtype or _default_out_dtype(y, residual)
    reason = _unsupported(y, row_scale, col_scale, bias, residual, gate, rows_per_batch, out_dtype)
    if reason:
        raise ValueError(f"linear_epilogue: {reason}")
    if not triton_runs_on(y.device) or y.numel() == 0:
        result = linear_epilogue_reference(y, row_scale=row_scale, col_scale=col_scale, bias=bias, residual=residual,
                                           gate=gate, rows_per_batch=rows_per_batch, out_dtype=out_dtype)  # fmt: skip
        return result if out is None else out.copy_(result)
    m, n = y.shape
    out = torch.empty((m, n), dtype=out_dtype, device=y.device) if out is None else out
    dummy = out
    launch(
        _linear_epilogue_kernel, (cdiv(m, BLOCK_M), cdiv(n, BLOCK_N)),
        y, y.stride(0), dummy if row_scale is None else row_scale, dummy if col_scale is None else col_scale,
        dummy if bias is None else bias, dummy if residual is None else residual,
        0 if residual is None else residual.stride(0), dummy if gate is None else gate,
        0 if gate is None else gate.stride(0), rows_per_batch, out, out.stride(0), m, n,
        DEQUANT=row_scale is not None, BIAS=bias is not None, RESIDUAL=residual is not None,
        OUT_DTYPE=TL_DTYPES[out_dtype], BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )  # fmt: skip
    return out
