"""INT8 W8A8 GEMM with the scales, and optionally the block's gated residual, applied in its epilogue.

    out = int8_linear(q, scale, weight, weight_scale, residual=None, gate=None, rows_per_batch=1)
        value = (q @ weight^T) * scale[m] * weight_scale[n]        (int32 accumulation, exact)
        out   = value                                             or residual + gate[row's batch] * value

Why ours: on the H200 `torch._int_mm` (cuBLAS) runs an Ampere-generation int8 kernel at about 850 TOP/s, barely
above bf16's 787 TFLOP/s (bench_quant), and returns int32 that a second pass must read back (4 bytes per
output). This Triton kernel reads both operands K-major (the activation row-major [M, K], the weight row-major
[N, K], as Hopper's 8-bit tensor-core instructions want them), accumulates in int32 and writes bf16 once, with
the dequantisation and the gated residual fused. Numerics are exactly `linear_epilogue_reference` of the int32
product: the same fp32 multiplies in the same order, the same roundings (tests check bit-identity).
"""

from __future__ import annotations

import torch

from ._triton import INTERPRETER_ACTIVE, TL_DTYPES, jit, tl, triton, triton_runs_on
from .linear_epilogue import (
    OUT_DTYPES,
    add_gated_residual,
    dequantize_tile,
    linear_epilogue_reference,
    residual_problem,
)

# Candidate tile shapes for the H200 (both operands K-major int8); bench_quant reports the chosen one per shape.
CONFIGS = [
    (128, 256, 128, 3, 8),
    (256, 128, 128, 3, 8),
    (128, 128, 128, 4, 8),
    (128, 256, 64, 4, 8),
    (64, 256, 128, 4, 4),
    (128, 128, 64, 5, 4),
]  # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
INTERPRETER_CONFIG = (16, 32, 32, 1, 4)


@jit
def _int8_gemm_kernel(
    a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, residual_ptr, gate_ptr, out_ptr, M, N, K, M_BUCKET,
    a_stride, b_stride, residual_stride, gate_stride, rows_per_batch, out_stride,
    RESIDUAL: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # Grouped program order: GROUP_M row tiles share each column tile of the weight while it is in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
    tile_n = (pid % (GROUP_M * tiles_n)) // group_size

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Loads wrap inside the matrices (rows % M) so only the K tail needs a mask; the store masks.
    a_ptrs = a_ptr + (rows % M).to(tl.int64)[:, None] * a_stride + ks[None, :]
    b_ptrs = b_ptr + (cols % N).to(tl.int64)[None, :] * b_stride + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for start in range(0, K, BLOCK_K):
        k_mask = ks < K - start
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0)
        b = tl.load(b_ptrs, mask=k_mask[:, None], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    row_mask = rows < M
    col_mask = cols < N
    value = dequantize_tile(acc, rows, cols, row_mask, col_mask, a_scale_ptr, b_scale_ptr).to(OUT_DTYPE)
    rows64 = rows.to(tl.int64)
    mask = row_mask[:, None] & col_mask[None, :]
    if RESIDUAL:
        value = add_gated_residual(value, rows64, cols, mask, residual_ptr, residual_stride, gate_ptr, gate_stride,
                                   rows_per_batch, OUT_DTYPE)  # fmt: skip
    tl.store(out_ptr + rows64[:, None] * out_stride + cols[None, :], value, mask=mask)


_tuned = None


def _autotuned():
    """The kernel behind triton.autotune over CONFIGS, keyed by the problem shape (tuned once per shape)."""
    global _tuned
    if _tuned is None:
        configs = [
            triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for m, n, k, s, w in CONFIGS
        ]
        # keyed by a power-of-two bucket of M, so prompts of every length do not each trigger a new tuning
        _tuned = triton.autotune(configs=configs, key=["M_BUCKET", "N", "K", "RESIDUAL"])(_int8_gemm_kernel)
    return _tuned


def _bucket(m: int) -> int:
    return min(triton.next_power_of_2(m), 16384)


def chosen_config(m: int, n: int, k: int, residual: bool) -> str | None:
    """The tile shape autotuning picked for this problem (for the benchmark's report), if tuned already."""
    if _tuned is None:
        return None
    for key, config in _tuned.cache.items():
        if tuple(key[:4]) == (_bucket(m), n, k, residual):
            return str(config)
    return None


def _unsupported(q, scale, weight, weight_scale, residual, gate, rows_per_batch, out_dtype) -> str | None:
    if q.dtype != torch.int8 or weight.dtype != torch.int8 or q.dim() != 2 or weight.dim() != 2:
        return f"q and weight must be 2-D int8, got {q.dtype} {tuple(q.shape)} and {weight.dtype} {tuple(weight.shape)}"
    if q.stride(1) != 1 or weight.stride(1) != 1 or q.shape[1] != weight.shape[1]:
        return f"q [M, K] and weight [N, K] need contiguous rows of one K, got {tuple(q.shape)}, {tuple(weight.shape)}"
    m, n = q.shape[0], weight.shape[0]
    if scale.shape != (m,) or weight_scale.shape != (n,):
        return f"scales must be [M]={m} and [N]={n} fp32, got {tuple(scale.shape)} and {tuple(weight_scale.shape)}"
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}"
    return residual_problem(residual, gate, m, n, rows_per_batch, out_dtype)


def int8_linear_reference(q, scale, weight, weight_scale, residual=None, gate=None, rows_per_batch=1, out_dtype=None):
    """The torch formulation: the exact int32 product, then kernels/linear_epilogue.py's reference."""
    # fp64 holds every partial sum exactly (|q w| <= 2^14, K << 2^39) on any device and shape; _int_mm refuses M <= 16
    acc = (q.double() @ weight.double().t()).to(torch.int32)
    return linear_epilogue_reference(acc, row_scale=scale, col_scale=weight_scale, residual=residual, gate=gate,
                                     rows_per_batch=rows_per_batch, out_dtype=out_dtype or torch.bfloat16)  # fmt: skip


def int8_linear(
    q: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    rows_per_batch: int = 1,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """q [M, K] int8 with scale [M] (per row), weight [N, K] int8 with weight_scale [N] -> [M, N] in out_dtype
    (default: the residual's, else bf16); see the module docstring. Raises where Triton cannot run."""
    out_dtype = out_dtype or (residual.dtype if residual is not None else torch.bfloat16)
    reason = _unsupported(q, scale, weight, weight_scale, residual, gate, rows_per_batch, out_dtype)
    if reason:
        raise ValueError(f"int8_linear: {reason}")
    if not triton_runs_on(q.device):
        raise RuntimeError(f"int8_linear: Triton cannot run on {q.device} here")
    m, k = q.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    args = (q, weight, scale, weight_scale, out if residual is None else residual, out if gate is None else gate, out,
            m, n, k, _bucket(m), q.stride(0), weight.stride(0), 0 if residual is None else residual.stride(0),
            0 if gate is None else gate.stride(0), rows_per_batch, out.stride(0))  # fmt: skip
    if INTERPRETER_ACTIVE:
        bm, bn, bk, _stages, warps = INTERPRETER_CONFIG
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
        _int8_gemm_kernel[grid](*args, RESIDUAL=residual is not None, OUT_DTYPE=TL_DTYPES[out_dtype], BLOCK_M=bm,
                                BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps)  # fmt: skip
        return out

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

    _autotuned()[grid](*args, RESIDUAL=residual is not None, OUT_DTYPE=TL_DTYPES[out_dtype])
    return out
