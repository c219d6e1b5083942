"""Attention for the two phases of a generation, without ever building a dense L x L mask.

Prefill (prefix only): block-causal. Each prefix segment attends to every key up to its own end;
text segments add a causal triangle over their own keys (bottom-right aligned), image blocks see
their whole block. One SDPA call per segment; the only masks are [segment, end] for text runs, so
memory stays O(L) with the flash/cuDNN/efficient kernels (at 1024^2 with 4 condition images, ~20k
tokens, the largest mask is a text run x 20k bools).

Decode (target only): target queries see the whole prefix and the whole target, i.e. plain full
attention over the K/V cache. The prefix part (kept once for the whole batch) and the step's target part
are two attention calls combined through their log-sum-exps, so the target K/V never persist beside the
prefix (the joint layout of kv_cache.py, one call over contiguous keys, remains for comparison).

Tensors are [B, S, H, D] ("BSHD") like the K/V cache; SDPA gets transposed views.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ...kernels import attention_merge
from ..sdpa import planless_kernels
from .sequence import Segment

# SDPA backend names accepted by the `attention_backend` option.
BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


def backend_context(name: str, prefill: bool = False):
    """A context manager restricting SDPA to one backend. "auto": torch's choice, except in the prefill
    (`prefill`), whose shapes are new at every changed prompt: there torch chooses among the kernels that plan
    nothing per shape (qwen21_core/sdpa.py: cuDNN's first call at a new length plans on the host, which is slow)."""
    if name == "auto":
        return planless_kernels() if prefill else contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    choice = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }.get(name)
    if choice is None:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    return sdpa_kernel([choice])


def _sdpa(q, k, v, mask=None):
    """SDPA on BSHD tensors; returns BSHD."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)


def prefix_masks(segments: tuple[Segment, ...], key_valid: torch.Tensor | None, device) -> list:
    """One mask (or None) per segment, built once per generation and shared by all layers. A text run's causal
    triangle is bottom-right aligned (its queries see every key before the run); on CUDA, without padded keys, it is
    torch's lower-right causal bias, which the flash kernel runs with no mask in memory, else a boolean mask."""
    masks = []
    on_cuda = torch.device(device).type == "cuda"
    for seg in segments:
        padded = key_valid is not None and not bool(key_valid[: seg.end].all())
        if seg.is_text and on_cuda and not padded:
            masks.append(causal_lower_right(seg.end - seg.start, seg.end))
            continue
        mask = torch.ones(seg.end - seg.start, seg.end, dtype=torch.bool).tril(seg.start) if seg.is_text else None
        if padded:
            valid = key_valid[: seg.end][None, :]
            mask = valid if mask is None else mask & valid
        masks.append(None if mask is None else mask.to(device)[None, None])
    return masks


def prefix_attention(q, k, v, segments: tuple[Segment, ...], masks: list, out: torch.Tensor) -> torch.Tensor:
    """Block-causal attention of the prefix. q, k, v, out: [B, P, H, D]; writes into and returns out."""
    for seg, mask in zip(segments, masks, strict=True):
        out[:, seg.start : seg.end] = _sdpa(q[:, seg.start : seg.end], k[:, : seg.end], v[:, : seg.end], mask)
    return out


def decode_attention(q, k, v, key_mask=None):
    """Target queries [B, N, H, D] over the joint K/V [B, P+N, H, D] of their own rows."""
    return _sdpa(q, k, v, key_mask)


# Decode attention's kernels with a log-sum-exp output, tried in order on CUDA; one that fails is dropped for the
# process. At a repeated shape cuDNN ran faster than flash over thousands of keys (a 1024^2 target, a prefix with
# references), but it plans each new shape on the host, which is slow, and a short text prefix changes length with
# every prompt, where flash was also faster (benchmarks/bench_attention_lengths.py measures both). So the target half
# and long prefixes run cuDNN, a text-only prefix flash.
PLANNED_KERNELS = ("cudnn", "flash")
SHORT_PREFIX_KERNELS = ("flash", "cudnn")
SHORT_PREFIX_KEYS = 1024  # a text-only prefix is shorter; one condition image at 512^2 already adds 1024 keys
_FAILED_LSE_KERNELS: set[str] = set()


def prefix_kernels(num_keys: int) -> tuple[str, ...]:
    """The kernels' order for the decode step's prefix half over `num_keys` cached keys."""
    return SHORT_PREFIX_KERNELS if num_keys <= SHORT_PREFIX_KEYS else PLANNED_KERNELS


def _cuda_lse_attention(q, k, v, kernels=PLANNED_KERNELS):
    for kernel in kernels:
        if kernel in _FAILED_LSE_KERNELS:
            continue
        try:
            if kernel == "cudnn":
                out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
            else:
                out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
            return out, lse.reshape(q.shape[:3])
        except (RuntimeError, NotImplementedError):
            if torch.cuda.is_current_stream_capturing():
                raise  # never switch kernels in the middle of a capture
            _FAILED_LSE_KERNELS.add(kernel)
    raise RuntimeError("no CUDA attention kernel with log-sum-exp output is available")


def _sdpa_with_lse(q, k, v, key_mask=None, kernels=PLANNED_KERNELS):
    """Attention output [B,H,S,D] and log-sum-exp [B,H,S] (fp32), inputs in BHSD; key_mask [1,1,1,K] bool; kernels:
    the CUDA kernels' order of preference."""
    if q.is_cuda and key_mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return _cuda_lse_attention(q, k, v, kernels)
    if q.is_cuda and key_mask is not None and k.shape[2] % 16 == 0:
        # a padded prefix: the memory-efficient kernel takes an additive bias and returns the lse
        bias = _additive(key_mask, q).expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True)[:2]
        return out, lse[..., : q.shape[2]]
    if q.device.type == "cpu":  # torch's CPU flash kernel: fused, with the lse (the fp32 matmul path was much slower)
        bias = None if key_mask is None else _additive(key_mask, q)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias)[:2]
        return out, lse
    scale = q.shape[-1] ** -0.5
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def _additive(key_mask, q):
    return torch.zeros(key_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~key_mask, float("-inf"))


def shared_prefix_decode_attention(q, k_prefix, v_prefix, k_target, v_target, prefix_key_mask=None):
    """Decode attention over the cached prefix and the step's own target keys, as one softmax.

    q, k_target, v_target: [B, N, H, D]; k_prefix, v_prefix: [1, P, H, D] (shared by the batch); prefix_key_mask:
    [P] bool. The prefix part runs once with the batch rows as extra query tokens (a free view of BSHD q); the two
    partial softmaxes are merged through their log-sum-exps in one pass (kernels/attention_merge.py):
    out = out_t + sigmoid(lse_p - lse_t) * (out_p - out_t).
    """
    b, n, h, d = q.shape
    q_folded = q.reshape(1, b * n, h, d).transpose(1, 2)  # [1, H, B*N, D], no copy
    mask = None if prefix_key_mask is None else prefix_key_mask[None, None, None, :]
    kernels = prefix_kernels(k_prefix.shape[1])
    out_p, lse_p = _sdpa_with_lse(q_folded, k_prefix.transpose(1, 2), v_prefix.transpose(1, 2), mask, kernels)
    out_t, lse_t = _sdpa_with_lse(q.transpose(1, 2), k_target.transpose(1, 2), v_target.transpose(1, 2))
    out_p = out_p.transpose(1, 2).reshape(b, n, h, d)  # back to BSHD rows
    lse_p = lse_p.reshape(h, b, n).permute(1, 2, 0)  # [B, N, H]
    return attention_merge.merge(out_p, lse_p, out_t.transpose(1, 2), lse_t.permute(0, 2, 1))  # [B, N, H, D]
