"""The block math around attention for quantised Linears, with the activation quantisation fused in.

Same function as transformer.py's `modulated_qkv` / `attention_out_and_mlp`, but every quantised projection
takes its input straight from a fused kernel (kernels/quantize_rows.py) and hands its output to one
(kernels/linear_epilogue.py):

    modulated LayerNorm + quantise -> QKV GEMM (scales in its epilogue) -> [QK-norm + RoPE, attention]
    quantise -> out GEMM + gated residual (int8: in the GEMM's epilogue; fp8: one epilogue pass)
    modulated LayerNorm + quantise -> gate_up GEMM -> SwiGLU + quantise -> down GEMM + gated residual

so no bf16 copy of an activation is written just to be quantised. A Linear that is not quantised (a layer kept
in bf16), or a device without the W8A8 instruction (weight-only path), takes the plain torch ops instead, per
layer. Not bit-identical to the bf16 path (lossy by construction); errors are measured in bench_dit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...kernels.linear_epilogue import linear_epilogue
from ...kernels.quantize_rows import LayerNormModulation
from ..quant.linear import Projected, QuantLinear


def _w8a8(layer, rows: int) -> str | None:
    """The layer's W8A8 backend for this many rows, or None for a plain Linear call (also where a LoRA side path
    needs the layer's float input: those layers run unfused)."""
    if isinstance(layer, QuantLinear) and layer.side_path is None:
        backend = layer.backend(rows)
        return None if backend == "weight_only" else backend
    return None


def _linear(layer, x2d: torch.Tensor) -> torch.Tensor:
    return layer(x2d) if isinstance(layer, QuantLinear) else F.linear(x2d, layer.weight)


def _modulated_norm(x2d, mod, eps):
    """The torch path: LayerNorm(x) * mod[row's batch], rounded like transformer.py's bf16 math."""
    normed = F.layer_norm(x2d, x2d.shape[-1:], eps=eps)
    return (normed.view(mod.shape[0], -1, normed.shape[-1]) * mod[:, None, :]).view_as(x2d)


def _project_modulated_norm(x2d, mod, rows_per_batch, eps, layer) -> Projected:
    backend = _w8a8(layer, x2d.shape[0])
    if backend is None:
        return Projected(_linear(layer, _modulated_norm(x2d, mod, eps)))
    q, scale = layer.quantize_input(x2d, layer_norm=LayerNormModulation(mod, rows_per_batch, eps))
    return layer.project(q, scale, backend)


def _gated_residual(x2d, projected: Projected, gate, rows_per_batch) -> torch.Tensor:
    return linear_epilogue(projected.data, row_scale=projected.row_scale, col_scale=projected.col_scale,
                           residual=x2d, gate=gate, rows_per_batch=rows_per_batch)  # fmt: skip


def modulated_qkv(x: torch.Tensor, scale1: torch.Tensor, layer, eps: float) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) -> the fused QKV projection. x [B, S, D], scale1 [B, 1, D] -> [B, S, 3D]."""
    b, s, d = x.shape
    projected = _project_modulated_norm(x.reshape(b * s, d), scale1.reshape(b, d), s, eps, layer)
    return projected.dense(x.dtype).view(b, s, -1)


def attention_out_and_mlp(x, attn, gate1, scale2, gate2, to_out, gate_up, down, eps: float) -> torch.Tensor:
    """Gated residual of the attention output, then the gated SwiGLU residual. x, attn: [B, S, D]."""
    b, s, d = x.shape
    rows = b * s
    x2d = x.reshape(rows, d)
    gate1, scale2, gate2 = gate1.reshape(b, d), scale2.reshape(b, d), gate2.reshape(b, d)

    attn2d = attn.reshape(rows, -1)
    backend = _w8a8(to_out, rows)
    if backend is None:
        x2d = _gated_residual(x2d, Projected(_linear(to_out, attn2d)), gate1, s)
    else:
        x2d = to_out.project_residual(*to_out.quantize_input(attn2d.contiguous()), backend, x2d, gate1, s)

    hidden = _project_modulated_norm(x2d, scale2, s, eps, gate_up)
    backend = _w8a8(down, rows)
    if backend is None:
        gate, up = hidden.dense(x.dtype).chunk(2, dim=-1)
        x2d = _gated_residual(x2d, Projected(_linear(down, F.silu(gate) * up)), gate2, s)
    else:
        dequant = None if hidden.row_scale is None else (hidden.row_scale, hidden.col_scale)
        q, scale = down.quantize_input(hidden.data, swiglu=True, dequant=dequant, act_dtype=x.dtype)
        x2d = down.project_residual(q, scale, backend, x2d, gate2, s)
    if x2d.dtype == torch.float16:
        x2d = x2d.clip(-65504, 65504)
    return x2d.view(b, s, d)
