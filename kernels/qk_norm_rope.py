"""Per-head RMSNorm + interleaved-pair RoPE on q and k, optionally writing k and v into a K/V cache.

Numerics follow the diffusers reference exactly (model_reference.md 1.5):
  norm:  var = mean(x.float()^2); y = x.float() * rsqrt(var + eps); y = y.to(w.dtype) if w is half; y = y * w
         then cast to the activation dtype;
  rope:  pairs (y[2i], y[2i+1]) read in fp32 and rotated by (cos_i, sin_i), one final rounding.

`qk_norm_rope` is what the transformer calls. (The Triton kernel and the token gate arrive with the
kernel work; until then the torch reference serves every device.)
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers RMSNorm over the last dim, returned in x's dtype."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    y = x * torch.rsqrt(variance + eps)  # promotes to fp32
    if weight.dtype in (torch.float16, torch.bfloat16):
        y = y.to(weight.dtype)
    return (y * weight).to(x.dtype)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of x [B, S, H, D] by angles given as cos/sin [S, D/2] (fp32)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    out = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, eps):
    """q, k: [B, S, H, D] (any strides). Returns new contiguous (q, k)."""
    q = rope_reference(rms_norm_reference(q, q_weight, eps), cos, sin)
    k = rope_reference(rms_norm_reference(k, k_weight, eps), cos, sin)
    return q, k


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
):
    """Normalise and rotate q and k of a fused QKV projection; copy v.

    qkv:          [B, S, 3, H, D] (a view of the QKV GEMM output; q, k, v along dim 2).
    cos, sin:     [S, D/2] fp32 rotation of each pair.
    k_out, v_out: optional [B, S, H, D] destinations (e.g. a slice of a preallocated K/V cache).
    Returns (q, k, v), each [B, S, H, D]; k and v are k_out and v_out when those are given.
    """
    q, k = qk_norm_rope_reference(qkv[:, :, 0], qkv[:, :, 1], q_weight, k_weight, cos, sin, eps)
    v = qkv[:, :, 2]
    if k_out is not None:
        k_out.copy_(k)
        k = k_out
    if v_out is not None:
        v_out.copy_(v)
        v = v_out
    return q, k, v
