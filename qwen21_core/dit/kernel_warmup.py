"""Compile the Triton kernels a DiT step launches before the first step needs them.

One block's step math (modulated LayerNorm + QKV projection, QK-norm + RoPE into a cache-like buffer, the split
prefix/target attention with its merge kernel, the output projection and the MLP with their fused quantisation
and epilogues) runs on a few rows of dummy input, the projections once per M bucket (kernels/launch_configs.py
`forced_bucket`): each bucket's tuned configuration compiles then, whatever the real row counts will be. Row and
token counts are not specialised on (kernels/_triton.py `jit`), so these few rows compile exactly the variants real
prompts use.

It runs on a copy of block 0 on the execution device, so it may run in a background thread while the model itself
is loaded, offloaded, streamed or merged with a LoRA (qwen21_core/startup/warmup.py); values are meaningless, only the
compiles count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...kernels.kv_quant import dequantize_kv, quantize_kv
from ...kernels.launch_configs import all_buckets, forced_bucket
from ...kernels.linear_epilogue import linear_epilogue
from ...kernels.qk_norm_rope import qk_norm_rope
from ..startup.warmup import shared_copy
from .attention import shared_prefix_decode_attention
from .transformer import EAGER, Modulation, QwenImage21Transformer, TextProjection, TimestepEmbedding

PRIMING_WIDTH = 64  # the tiny entry modules of `prime_entry_ops`: any width loads the same torch kernels
WARMUP_ROWS = 16  # the smallest tensor-core row tile
# The buckets of a 1024^2 image (4096 target rows) and of a typical prompt (up to a couple of hundred tokens with the
# template): the first image needs them, the others only sizes, prompts and reference counts met later.
FIRST_BUCKETS = (4096, 128, 256)
PART = "dit"  # the part the sampler waits for: what any first image needs


def later_buckets() -> list[int]:
    return [b for b in all_buckets() if b not in FIRST_BUCKETS]


def bucket_part(bucket: int) -> str:
    """The warm-up part compiling a later bucket: a launch of that bucket waits for it (startup/model_warmup.py
    `PendingBuckets`), the sampler does not."""
    return f"{PART}:{bucket}"


def dit_warmup_parts(transformer: QwenImage21Transformer, device: torch.device) -> dict[str, list[Callable[[], None]]]:
    """The DiT's warm-up as small independent jobs (they run on a thread pool, startup/warmup.py), in two kinds
    of part. PART: QK-norm+RoPE and the attention merge, the K/V-cache formats, and the FIRST_BUCKETS' projections;
    with them every kernel that is not keyed by M bucket has compiled. `bucket_part(b)` for every later bucket:
    its QKV projection and the block's finish (output projection and MLP). Waiting for every bucket's compiles held
    the first image on a fresh machine back for seconds, so the sampler waits for PART only and a later bucket is
    waited for where a launch needs it. No job compiles more than a few kernels."""
    config = transformer.config
    block = shared_copy(transformer.transformer_blocks[0], device)

    def job(part: str, bucket: int = FIRST_BUCKETS[0]):
        return lambda: warm_up(block(), config, part, bucket)

    first = [job("attention")]
    for bucket in FIRST_BUCKETS:
        first += [job("qkv", bucket), job("finish", bucket)]
    first.append(lambda: warm_up_kv_formats(config, device, transformer.dtype))
    parts = {PART: first}
    for bucket in later_buckets():
        parts[bucket_part(bucket)] = [job("qkv", bucket), job("finish", bucket)]
    return parts


@torch.no_grad()
def warm_up(block, config, part: str, bucket: int) -> None:
    """One piece of `block`'s step math on WARMUP_ROWS dummy rows, with `bucket`'s launch configurations: "qkv" (the
    modulated QKV projection), "attention" (QK-norm + RoPE into a cache-like buffer, the split attention and its
    merge; and the control branch's skip epilogue) or "finish" (the output projection and the MLP with their gated
    residuals)."""
    device = next(block.parameters()).device
    dtype = block.attn.norm_q_weight.dtype
    heads, head_dim = config.num_attention_heads, config.attention_head_dim
    gen = torch.Generator(device=device).manual_seed(bucket)
    x = torch.randn(1, WARMUP_ROWS, config.inner_dim, device=device, generator=gen).to(dtype)
    ones = torch.ones(1, 1, config.inner_dim, device=device, dtype=dtype)
    mod = Modulation(ones, ones, ones, ones)
    with forced_bucket(bucket):
        if part == "qkv":
            block._qkv(x, mod.scale1, EAGER)
        elif part == "finish":
            block._finish(x, x.unflatten(-1, (heads, head_dim)), mod, EAGER)
        elif part == "attention":
            qkv = torch.randn(1, WARMUP_ROWS, 3, heads, head_dim, device=device, generator=gen).to(dtype)
            cos = torch.ones(WARMUP_ROWS, head_dim // 2, device=device)
            # K/V written into a slice of a longer buffer, as into the prefix cache
            cache = torch.empty(2, 1, 2 * WARMUP_ROWS, heads, head_dim, device=device, dtype=dtype)
            q, k, v = qk_norm_rope(qkv, block.attn.norm_q_weight, block.attn.norm_k_weight, cos, torch.zeros_like(cos),
                                   block.eps, k_out=cache[0, :, :WARMUP_ROWS], v_out=cache[1, :, :WARMUP_ROWS],
                                   min_tokens=0)  # fmt: skip
            shared_prefix_decode_attention(q, k, v, k, v)
            # a quantised control branch's skip: its bias and strength-weighted add in one pass (dit/control.py)
            rows = x[0]
            linear_epilogue(rows, bias=ones[0, 0], residual=rows, gate=ones[0], rows_per_batch=WARMUP_ROWS)
        else:
            raise ValueError(f"unknown warm-up part {part!r}")


@torch.no_grad()
def warm_up_kv_formats(config, device: torch.device, dtype: torch.dtype) -> None:
    """The dequantiser of the fp8/int8 K/V cache formats (kv_cache option), for this model's head size."""
    x = torch.randn(WARMUP_ROWS, config.num_attention_heads, config.attention_head_dim, device=device, dtype=dtype)
    for fmt in ("fp8", "int8"):
        values, scale = quantize_kv(x, fmt)
        dequantize_kv(values, scale, torch.empty_like(x))


@torch.no_grad()
def prime_entry_ops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
    """The torch kernels a prefill and a step launch outside the blocks, on tiny modules of the same classes and
    without any model (qwen21_core/startup/priming.py): the timestep sinusoid and its MLP, the text projection (fp32
    RMSNorm, GELU-tanh) and the scatter of its rows into the prefix. Values are meaningless (uninitialised weights)."""
    with torch.device("meta"):
        embed = TimestepEmbedding(PRIMING_WIDTH)
        project = TextProjection(PRIMING_WIDTH, PRIMING_WIDTH, eps=1e-6)
    embed = embed.to(dtype).to_empty(device=device)
    project = project.to(dtype).to_empty(device=device)
    embed(torch.zeros(1, device=device, dtype=dtype))
    prefix = torch.empty(1, 8, PRIMING_WIDTH, device=device, dtype=dtype)
    prefix[0, torch.arange(0, 8, 2, device=device)] = project(torch.zeros(4, PRIMING_WIDTH, device=device, dtype=dtype))
