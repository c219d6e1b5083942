"""Per-head RMSNorm + interleaved-pair RoPE on q and k, optionally writing k and v into a K/V cache.

Numerics follow the diffusers reference (its RMSNorm on q and k, then its interleaved-pair RoPE):
  norm:  var = mean(x.float()^2); y = x.float() * rsqrt(var + eps); y = y.to(w.dtype) if w is half; y = y * w
         then cast to the activation dtype;
  rope:  pairs (y[2i], y[2i+1]) read in fp32 and rotated by (cos_i, sin_i), one final rounding.

The Triton kernel does every step in the same order with the same roundings, and is compiled without
fp contraction (no fused multiply-add), so each multiply, add and cast rounds where the reference's does.
The one step it cannot reproduce is the ORDER of the fp32 sum of squares (the reference's order belongs to
torch's reduction kernel); that can move a head's scale by an fp32 ulp. Stated and tested:
- bit-identical to the reference whenever that sum is exact in any order;
- otherwise every element of q and k is within 2 ulp (fp16, bf16) or 4 ulp (fp32) of the output dtype at
  the magnitude of its rotated pair (a 1-ulp flip of a normalised half value can become 2 ulp after the
  weight multiply), and in half precision few elements differ at all (measured through the interpreter at
  200 tokens x 32 heads x 128: 5e-5 of fp16 elements, 6e-6 of bf16);
- v is copied bit for bit.

`qk_norm_rope` is what the transformer calls. It uses the fused kernel when Triton can run on the tensors'
device and the batch holds enough tokens (B*S) to pay for the launch; the threshold is below.
Everything else (CPU, no Triton, short sequences) takes the torch reference.
"""

from __future__ import annotations

import torch

from ._triton import cdiv, jit, next_power_of_2, tl, triton_runs_on
from .launch import launch

# Token gate: the fused kernel is used when B*S >= the threshold (0 = always). On the eager path each call
# pays host launch overhead, which the fused kernel loses on short sequences; inside a captured CUDA graph
# that overhead is gone, hence a separate threshold: the `min_tokens=` argument, else the default. The fused kernel
# won at every length benchmarks/bench_qk_norm_rope.py measured, from short text prefixes to the longest images,
# eager and in a graph, so both gates default to 0 = always. A fused path that is host-bound needs a high gate;
# ours launches directly (kernels/launch.py) and is not.
DEFAULT_MIN_TOKENS = 0
DEFAULT_MIN_TOKENS_IN_GRAPH = 0

# Launch shape of the fused kernel: elements per program (heads x padded head_dim) and warps per program.
# Chosen by bench_qk_norm_rope.py --sweep: one shape that was best, or close to it, at short and long sequences
# alike, so no per-length choice is needed.
TILE_ELEMENTS = 4096
NUM_WARPS = 1

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Torch reference
# ---------------------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------------------
# Triton kernel and launcher
# ---------------------------------------------------------------------------------------------------------


@jit(do_not_specialize=("seq_len",))  # prompt lengths vary: one compile for all (see _triton.jit)
def _qk_norm_rope_kernel(
    qkv_ptr,  # [B, S, 3, H, D]: q, k, v along dim 2
    q_weight_ptr,  # [D]
    k_weight_ptr,  # [D], same dtype as q_weight
    cos_ptr,  # [S, D/2] fp32
    sin_ptr,  # [S, D/2] fp32
    q_out_ptr,  # [B, S, H, D]
    k_out_ptr,  # [B, S, H, D]
    v_out_ptr,  # [B, S, H, D]; only written when the grid has v programs
    seq_len,
    num_heads,
    head_dim,
    inv_head_dim,  # 1/D in fp32: the mean multiplies by it, as torch's CUDA mean does
    eps,
    qkv_stride_b,
    qkv_stride_s,
    qkv_stride_part,
    qkv_stride_h,
    qkv_stride_d,
    q_out_stride_b,
    q_out_stride_s,
    q_out_stride_h,
    q_out_stride_d,
    k_out_stride_b,
    k_out_stride_s,
    k_out_stride_h,
    k_out_stride_d,
    v_out_stride_b,
    v_out_stride_s,
    v_out_stride_h,
    v_out_stride_d,
    cos_stride_s,
    cos_stride_i,
    sin_stride_s,
    sin_stride_i,
    BLOCK_H: tl.constexpr,  # heads per program
    BLOCK_PAIRS: tl.constexpr,  # next power of two >= D/2
):
    # Program (token, part * head_blocks + head_block): one tile of BLOCK_H heads of q (part 0),
    # k (part 1) or v (part 2, a plain copy) of one token.
    token = tl.program_id(0).to(tl.int64)  # 64-bit: offsets into a large K/V cache overflow 32 bits
    head_blocks = tl.cdiv(num_heads, BLOCK_H)
    part = tl.program_id(1) // head_blocks
    b = token // seq_len
    s = token % seq_len

    heads = (tl.program_id(1) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, 2 * BLOCK_PAIRS)
    mask = (heads < num_heads)[:, None] & (dims < head_dim)[None, :]
    src = qkv_ptr + b * qkv_stride_b + s * qkv_stride_s + part * qkv_stride_part
    x_raw = tl.load(src + heads[:, None] * qkv_stride_h + dims[None, :] * qkv_stride_d, mask=mask, other=0.0)

    if part == 2:
        v_dst = v_out_ptr + b * v_out_stride_b + s * v_out_stride_s
        tl.store(v_dst + heads[:, None] * v_out_stride_h + dims[None, :] * v_out_stride_d, x_raw, mask=mask)
    else:
        if part == 0:
            weight_ptr = q_weight_ptr
            dst = q_out_ptr + b * q_out_stride_b + s * q_out_stride_s
            dst = dst + heads[:, None] * q_out_stride_h + dims[None, :] * q_out_stride_d
        else:
            weight_ptr = k_weight_ptr
            dst = k_out_ptr + b * k_out_stride_b + s * k_out_stride_s
            dst = dst + heads[:, None] * k_out_stride_h + dims[None, :] * k_out_stride_d

        # RMSNorm, rounding where the reference does.
        x = x_raw.to(tl.float32)
        mean_square = tl.sum(x * x, axis=1) * inv_head_dim  # [BLOCK_H]
        y = x * tl.math.rsqrt(mean_square + eps)[:, None]
        weight = tl.load(weight_ptr + dims, mask=dims < head_dim, other=0.0)
        if weight.dtype != tl.float32:
            # Half-precision weight: round to it, then multiply; the fp32 product of two halves is exact,
            # so one rounding back gives the reference's half-precision multiply.
            y = (y.to(weight.dtype).to(tl.float32) * weight.to(tl.float32)).to(weight.dtype)
        else:
            y = y * weight
        y = y.to(x_raw.dtype).to(tl.float32)  # the reference stores the norm in the activation dtype

        # RoPE on interleaved pairs (y[2i], y[2i+1]), in fp32.
        pairs = tl.arange(0, BLOCK_PAIRS)
        pair_mask = pairs < head_dim // 2
        cos = tl.load(cos_ptr + s * cos_stride_s + pairs * cos_stride_i, mask=pair_mask, other=0.0)[None, :]
        sin = tl.load(sin_ptr + s * sin_stride_s + pairs * sin_stride_i, mask=pair_mask, other=0.0)[None, :]
        even, odd = tl.split(tl.reshape(y, (BLOCK_H, BLOCK_PAIRS, 2)))
        rotated = tl.join(even * cos - odd * sin, even * sin + odd * cos)
        out = tl.reshape(rotated, (BLOCK_H, 2 * BLOCK_PAIRS))
        tl.store(dst, out.to(x_raw.dtype), mask=mask)


def _launch_fused(qkv, q_weight, k_weight, cos, sin, eps, k_out, v_out, tile_elements, num_warps):
    """Run the kernel on checked inputs. Returns (q, k, v) like `qk_norm_rope`."""
    batch, seq, _, heads, head_dim = qkv.shape
    q = torch.empty((batch, seq, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty_like(q) if k_out is None else k_out
    v = qkv[:, :, 2] if v_out is None else v_out
    # Without v_out the grid has no v programs; q only stands in for the unused pointer and strides.
    v_target = q if v_out is None else v_out

    block_pairs = next_power_of_2(head_dim // 2)
    block_h = min(next_power_of_2(heads), max(1, tile_elements // (2 * block_pairs)))
    parts = 2 if v_out is None else 3
    grid = (batch * seq, parts * cdiv(heads, block_h))
    launch(
        _qk_norm_rope_kernel,
        grid,
        qkv,
        q_weight,
        k_weight,
        cos,
        sin,
        q,
        k,
        v_target,
        seq,
        heads,
        head_dim,
        1.0 / head_dim,
        float(eps),
        *qkv.stride(),
        *q.stride(),
        *k.stride(),
        *v_target.stride(),
        *cos.stride(),
        *sin.stride(),
        BLOCK_H=block_h,
        BLOCK_PAIRS=block_pairs,
        num_warps=num_warps,
        enable_fp_fusion=False,  # round each multiply and add on its own, like the reference
    )
    return q, k, v


def qk_norm_rope_fused(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    *,
    tile_elements: int = TILE_ELEMENTS,
    num_warps: int = NUM_WARPS,
):
    """The fused kernel alone, whatever the token count (arguments and result as `qk_norm_rope`).

    tile_elements, num_warps: launch shape (for tuning; the defaults are what `qk_norm_rope` uses).
    Raises RuntimeError where Triton cannot run on qkv's device.
    """
    _check_inputs(qkv, q_weight, k_weight, cos, sin, eps, k_out, v_out)
    if not triton_runs_on(qkv.device):
        raise RuntimeError(
            f"qk_norm_rope_fused: Triton cannot run on {qkv.device} here (needs Triton and a CUDA device, "
            "or TRITON_INTERPRET=1 for CPU tensors); use qk_norm_rope, which falls back to the torch reference"
        )
    return _launch_fused(qkv, q_weight, k_weight, cos, sin, eps, k_out, v_out, tile_elements, num_warps)


# ---------------------------------------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------------------------------------


def fusion_min_tokens(in_graph: bool = False) -> int:
    """The default token threshold (eager or in-graph)."""
    return DEFAULT_MIN_TOKENS_IN_GRAPH if in_graph else DEFAULT_MIN_TOKENS


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    *,
    min_tokens: int | None = None,
    in_graph: bool = False,
):
    """Normalise and rotate q and k of a fused QKV projection; copy v.

    qkv:          [B, S, 3, H, D] (a view of the QKV GEMM output; q, k, v along dim 2), fp16/bf16/fp32.
    q_weight, k_weight: [D] RMSNorm weights, one dtype.
    cos, sin:     [S, D/2] fp32 rotation of each pair.
    k_out, v_out: optional [B, S, H, D] destinations in qkv's dtype, any strides (e.g. a slice of a
                  preallocated K/V cache).
    min_tokens:   use the fused kernel when B*S >= this (0 = always); None: the default (see the constants at
                  the top of this module).
    in_graph:     True while capturing a CUDA graph: selects the in-graph threshold.
    Returns (q, k, v), each [B, S, H, D]; k and v are k_out and v_out when those are given (v is a view
    of qkv otherwise). Both paths accept and reject exactly the same inputs.
    """
    _check_inputs(qkv, q_weight, k_weight, cos, sin, eps, k_out, v_out)
    if min_tokens is None:
        min_tokens = fusion_min_tokens(in_graph)
    elif isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"qk_norm_rope: min_tokens must be an integer >= 0 or None, got {min_tokens!r}")

    tokens = qkv.shape[0] * qkv.shape[1]
    if qkv.numel() > 0 and tokens >= min_tokens and triton_runs_on(qkv.device):
        return _launch_fused(qkv, q_weight, k_weight, cos, sin, eps, k_out, v_out, TILE_ELEMENTS, NUM_WARPS)

    q, k = qk_norm_rope_reference(qkv[:, :, 0], qkv[:, :, 1], q_weight, k_weight, cos, sin, eps)
    v = qkv[:, :, 2]
    if k_out is not None:
        k_out.copy_(k)
        k = k_out
    if v_out is not None:
        v_out.copy_(v)
        v = v_out
    return q, k, v


def _check_inputs(qkv, q_weight, k_weight, cos, sin, eps, k_out, v_out):
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qk_norm_rope: qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError(
            f"qk_norm_rope: qkv must be [B, S, 3, H, D] (q, k, v along dim 2), got shape {tuple(qkv.shape)}; "
            "view the QKV projection output as (B, S, 3, heads, head_dim)"
        )
    if qkv.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"qk_norm_rope: qkv must be float16, bfloat16 or float32, got {qkv.dtype}")
    batch, seq, _, heads, head_dim = qkv.shape
    if head_dim % 2:
        raise ValueError(f"qk_norm_rope: head_dim must be even (RoPE rotates pairs), got {head_dim}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"qk_norm_rope: eps must be a float, got {type(eps).__name__}")

    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        _check_tensor(name, weight, (head_dim,), "[D]", _FLOAT_DTYPES, qkv.device)
    if k_weight.dtype != q_weight.dtype:
        raise TypeError(
            f"qk_norm_rope: q_weight is {q_weight.dtype} but k_weight is {k_weight.dtype}; give both one dtype"
        )
    for name, table in (("cos", cos), ("sin", sin)):
        _check_tensor(name, table, (seq, head_dim // 2), "[S, D/2]", (torch.float32,), qkv.device)
    for name, out in (("k_out", k_out), ("v_out", v_out)):
        if out is not None:
            _check_tensor(name, out, (batch, seq, heads, head_dim), "[B, S, H, D]", (qkv.dtype,), qkv.device)


def _check_tensor(name, tensor, shape, layout, dtypes, device):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"qk_norm_rope: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"qk_norm_rope: {name} must be {layout} = {shape} to match qkv, got {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"qk_norm_rope: {name} must be {expected}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"qk_norm_rope: {name} is on {tensor.device} but qkv is on {device}; move it to {device}")
