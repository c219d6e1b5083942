"""Quantised prefix K/V: one scale per token and head (absmax / QMAX over head_dim), fp8 e4m3 or int8 storage.

    q, scale = quantize_kv(k, "fp8" | "int8")      # k [..., H, D] -> q [..., H, D], scale [..., H] fp32
    dequantize_kv(q, scale, out)                    # -> out [..., H, D] in out's dtype (bf16)

The prefix is quantised once per generation (torch: not on any step's critical path); each decode step
dequantises one layer at a time into a reused buffer right before its attention (the Triton kernel: one read of
q and scale, one write), so no bf16 copy of the whole prefix is ever held. Numerics: value = q * scale in fp32,
one rounding to the output dtype; the kernel and the reference are bit-identical.
"""

from __future__ import annotations

import torch

from ._triton import cdiv, jit, next_power_of_2, tl, triton_runs_on
from .launch import launch

QMAX = {"fp8": 448.0, "int8": 127.0}
STORAGE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
BLOCK_ROWS = 16  # (token, head) rows per program
NUM_WARPS = 4


def quantize_kv(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] in STORAGE[fmt], scale [...] fp32), one scale per row (token and head)."""
    v = x.float()
    scale = v.abs().amax(dim=-1).clamp(min=1e-30) / QMAX[fmt]
    values = v / scale[..., None]
    if fmt == "int8":
        return values.round_().clamp_(-128, 127).to(torch.int8), scale
    return values.clamp_(-QMAX["fp8"], QMAX["fp8"]).to(torch.float8_e4m3fn), scale


def dequantize_kv_reference(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(q.float() * scale[..., None])


@jit(do_not_specialize=("rows",))  # prefix lengths vary: one compile for all (see _triton.jit)
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, rows, D, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (r < rows)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + r[:, None] * D + d[None, :], mask=mask).to(tl.float32)  # masked lanes are never stored
    s = tl.load(s_ptr + r, mask=r < rows, other=0.0)
    out = q * s[:, None]
    tl.store(out_ptr + r[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = q * scale per row, written into `out` (contiguous, q's shape); returns out."""
    if q.shape != out.shape or scale.shape != q.shape[:-1] or not (q.is_contiguous() and out.is_contiguous()):
        raise ValueError(
            f"dequantize_kv: q {tuple(q.shape)} and out {tuple(out.shape)} must be one contiguous shape and scale "
            f"{tuple(scale.shape)} its leading dims"
        )
    if not triton_runs_on(q.device) or q.numel() == 0:
        return dequantize_kv_reference(q, scale, out)
    d = q.shape[-1]
    rows = q.numel() // d
    launch(
        _dequantize_kernel, (cdiv(rows, BLOCK_ROWS),),
        q, scale.contiguous(), out, rows, d, BLOCK_ROWS=BLOCK_ROWS, BLOCK_D=next_power_of_2(d),
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
