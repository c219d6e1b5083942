"""INT8 W8A8 GEMM with the scales, and optionally the block's gated residual, applied in its epilogue.

    out = int8_linear(q, scale, weight, weight_scale, residual=None, gate=None, rows_per_batch=1)
        value = (q @ weight^T) * scale[m] * weight_scale[n]        (int32 accumulation, exact)
        out   = value                                             or residual + gate[row's batch] * value

Why ours: on Hopper `torch._int_mm` (cuBLAS) runs an Ampere-generation int8 kernel, barely faster than bf16
(benchmarks/bench_quant.py measures both), and returns int32 that a second pass must read back (4 bytes per
output). This Triton kernel reads both operands K-major (the activation row-major [M, K], the weight row-major
[N, K], as Hopper's 8-bit tensor-core instructions want them), accumulates in int32 and writes bf16 once, with
the dequantisation and the gated residual fused. Numerics are exactly `linear_epilogue_reference` of the int32
product: the same fp32 multiplies in the same order, the same roundings (tests check bit-identity).
"""

from __future__ import annotations

import torch

from ._triton import INTERPRETER_ACTIVE, TL_DTYPES, cdiv, jit, tl, triton_runs_on
from .launch_configs import LaunchConfig, TunedKernel, m_bucket
from .linear_epilogue import (
    OUT_DTYPES,
    add_gated_residual,
    dequantize_tile,
    linear_epilogue_reference,
    residual_problem,
)

# Candidate tile shapes (both operands K-major int8), (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps): the tuner's and the
# autotuner's search space (benchmarks/tune_kernels.py writes the chosen one per shape into kernels/tuned/).
CANDIDATES = [
    (128, 256, 128, 3, 8),
    (256, 128, 128, 3, 8),
    (128, 128, 128, 4, 8),
    (128, 256, 64, 4, 8),
    (64, 256, 128, 4, 4),
    (128, 128, 64, 5, 4),
    (64, 128, 128, 4, 4),
    (64, 64, 128, 4, 4),
    (32, 128, 128, 4, 4),
    (16, 128, 128, 4, 4),
]
INTERPRETER_CONFIG = (16, 32, 32, 1, 4)


def _config(block_m, block_n, block_k, stages, warps) -> LaunchConfig:
    return LaunchConfig.of(warps, stages, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8)


def _rule(key: dict) -> LaunchConfig:
    """Any card with int8 tensor cores (SM 7.5+): 48 KiB of shared memory at most, a row tile no taller than needed."""
    return _config(64 if key["M_BUCKET"] <= 64 else 128, 128, 64, 3, 4)


def _candidates(key: dict) -> list[LaunchConfig]:
    """CANDIDATES without row tiles more than twice the rows (their extra rows are wasted work)."""
    return [_config(*c) for c in CANDIDATES if c[0] <= max(16, 2 * key["M_BUCKET"])]


TUNED = TunedKernel("int8_gemm", ("M_BUCKET", "N", "K", "RESIDUAL"), _rule, _candidates)


# M, M_BUCKET and rows_per_batch change with the prompt: not specialised on, so a new length never compiles anew
@jit(do_not_specialize=("M", "M_BUCKET", "rows_per_batch"))
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


def chosen_config(m: int, n: int, k: int, residual: bool, device: torch.device) -> str:
    """The launch configuration this problem runs with on `device`, and where it came from (for benchmarks)."""
    from .launch_configs import architecture

    config, source = TUNED.lookup(architecture(device), _key(m, n, k, residual))
    return f"{config} ({source})"


def _key(m: int, n: int, k: int, residual: bool) -> dict:
    return {"M_BUCKET": m_bucket(m), "N": n, "K": k, "RESIDUAL": bool(residual)}


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
    key = _key(m, n, k, residual is not None)
    args = (q, weight, scale, weight_scale, out if residual is None else residual, out if gate is None else gate, out,
            m, n, k, key["M_BUCKET"], q.stride(0), weight.stride(0), 0 if residual is None else residual.stride(0),
            0 if gate is None else gate.stride(0), rows_per_batch, out.stride(0))  # fmt: skip
    constexprs = dict(RESIDUAL=residual is not None, OUT_DTYPE=TL_DTYPES[out_dtype])
    if INTERPRETER_ACTIVE:
        config = _config(*INTERPRETER_CONFIG)
        _int8_gemm_kernel[_grid(m, n, config)](*args, **constexprs, **config.as_dict())
        return out
    TUNED.launch(_int8_gemm_kernel, lambda config: _grid(m, n, config), args, constexprs, key, q.device)
    return out


def _grid(m: int, n: int, config: LaunchConfig) -> tuple[int]:
    meta = config.meta_dict()
    return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)
