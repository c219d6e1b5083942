"""Merge two partial attentions over disjoint key sets into one, through their log-sum-exps, in one pass.

Decode attention runs the target queries once over the cached prefix keys and once over the step's own target
keys; the exact full-attention result is

    out = out_t + (out_p - out_t) * sigmoid(lse_p - lse_t)

(the prefix part's share of each row's softmax mass is sigmoid(lse_p - lse_t)). The torch formulation needs
several fp32 passes over [B, N, H, D]; the kernel reads both outputs once and writes the merged one.

Layouts: out_p and out_t are [B, N, H, D] views of SDPA's BHSD outputs (any strides); lse_p and lse_t are
[B, N, H] views of SDPA's [B, H, N] log-sum-exps (fp32). Numerics: fp32 arithmetic as the reference, one rounding
to the output dtype; the sigmoid uses the GPU's exp, so results agree with the reference to about an ulp.
"""

from __future__ import annotations

import torch

from ._triton import cdiv, jit, next_power_of_2, tl, triton_runs_on
from .launch import launch

BLOCK_H = 8  # heads per program; the program covers one token's BLOCK_H heads x head_dim
NUM_WARPS = 4


def merge_reference(out_p, lse_p, out_t, lse_t) -> torch.Tensor:
    weight = torch.sigmoid(lse_p - lse_t)[..., None]
    return (out_t.float() + (out_p.float() - out_t.float()) * weight).to(out_t.dtype)


# Token counts vary, and so do the log-sum-exps' strides, which are products of them ([B, H, N] permuted): none
# is specialised on, so a new size compiles nothing (with them specialised, the GPU warm-up test found a new variant
# compiled per stride class).
@jit(do_not_specialize=("N", "lp_sb", "lp_sn", "lp_sh", "lt_sb", "lt_sn", "lt_sh"))
def _merge_kernel(
    op_ptr, lp_ptr, ot_ptr, lt_ptr, out_ptr, N, H, D,
    op_sb, op_sn, op_sh, op_sd, lp_sb, lp_sn, lp_sh, ot_sb, ot_sn, ot_sh, ot_sd, lt_sb, lt_sn, lt_sh,
    out_sb, out_sn, out_sh, out_sd,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    b = token // N
    n = token % N
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < H
    mask = head_mask[:, None] & (dims < D)[None, :]
    lse_p = tl.load(lp_ptr + b * lp_sb + n * lp_sn + heads * lp_sh, mask=head_mask, other=0.0)
    lse_t = tl.load(lt_ptr + b * lt_sb + n * lt_sn + heads * lt_sh, mask=head_mask, other=0.0)
    weight = 1.0 / (1.0 + tl.exp(lse_t - lse_p))  # sigmoid(lse_p - lse_t)
    part_p = tl.load(op_ptr + b * op_sb + n * op_sn + heads[:, None] * op_sh + dims[None, :] * op_sd, mask=mask)
    part_t = tl.load(ot_ptr + b * ot_sb + n * ot_sn + heads[:, None] * ot_sh + dims[None, :] * ot_sd, mask=mask)
    p, t = part_p.to(tl.float32), part_t.to(tl.float32)
    out = t + (p - t) * weight[:, None]
    dst = out_ptr + b * out_sb + n * out_sn + heads[:, None] * out_sh + dims[None, :] * out_sd
    tl.store(dst, out.to(part_t.dtype), mask=mask)


def merge(out_p, lse_p, out_t, lse_t) -> torch.Tensor:
    """The merged attention [B, N, H, D] in out_t's dtype (see the module docstring)."""
    if out_p.shape != out_t.shape or out_p.dim() != 4 or lse_p.shape != out_p.shape[:3] or lse_t.shape != lse_p.shape:
        raise ValueError(
            f"merge: outputs must be [B, N, H, D] and log-sum-exps [B, N, H], got {tuple(out_p.shape)}, "
            f"{tuple(out_t.shape)}, {tuple(lse_p.shape)}, {tuple(lse_t.shape)}"
        )
    if not triton_runs_on(out_t.device) or out_t.numel() == 0:
        return merge_reference(out_p, lse_p, out_t, lse_t)
    b, n, h, d = out_t.shape
    out = torch.empty((b, n, h, d), dtype=out_t.dtype, device=out_t.device)
    block_h = min(BLOCK_H, next_power_of_2(h))
    launch(
        _merge_kernel, (b * n, cdiv(h, block_h)),
        out_p, lse_p, out_t, lse_t, out, n, h, d, *out_p.stride(), *lse_p.stride(), *out_t.stride(), *lse_t.stride(),
        *out.stride(), BLOCK_H=block_h, BLOCK_D=next_power_of_2(d), num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
