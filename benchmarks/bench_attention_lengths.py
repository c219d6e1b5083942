"""What a prompt length met for the first time costs in attention, per kernel (the changed prompt's hidden cost).

    python benchmarks/bench_attention_lengths.py            # H200: one JSON line per kernel and shape
    python benchmarks/bench_attention_lengths.py --lengths 4

A changed prompt changes the prefix length, so every attention call of its encode, the DiT's prefill and the first
decode step meets a new shape. Some kernels plan per shape on the host (cuDNN builds an execution plan for each new
shape and caches it), so their first call at a length costs far more than the second. For each kernel this times,
over `--lengths` lengths never seen before in the process, the first call at a length and a repeat at the same
length (both with the GPU idle before and synchronised after), and prints the medians:
- `dit_prefill`: the DiT's text prefix attending to itself, causally (32 heads of 128), as SDPA picks with a boolean
  mask (what prefix_attention passed before), and each kernel forced;
- `dit_decode_prefix`: a 1024^2 image's 4096 query rows over the prefix keys, with the log-sum-exp (the decode
  step's prefix half), cuDNN against flash;
- `text_encoder`: Qwen3-VL-8B's causal self-attention (32 query heads, 8 key/value heads of 128).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F
from _common import emit
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def measure(name: str, shape_for, call, lengths: list[int], **fields) -> None:
    firsts, repeats = [], []
    for length in lengths:
        args = shape_for(length)
        try:
            firsts.append(timed(lambda args=args: call(*args)))
            repeats.append(timed(lambda args=args: call(*args)))
        except RuntimeError as error:
            emit(what="attention_length", case=name, error=str(error).splitlines()[0][:200], **fields)
            return
    emit(what="attention_length", case=name, first_ms=round(statistics.median(firsts), 3),
         repeat_ms=round(statistics.median(repeats), 3), first_max_ms=round(max(firsts), 3),
         lengths=len(lengths), **fields)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, default=8, help="new lengths per kernel")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    start = [97]  # every case gets lengths no earlier case used: a plan cached by one must not help the next

    def fresh_lengths() -> list[int]:
        lengths = list(range(start[0], start[0] + 3 * args.lengths, 3))
        start[0] += 3 * args.lengths + 1
        return lengths

    def bhsd(heads: int, length: int):
        return torch.randn(1, heads, length, 128, device=device, dtype=dtype)

    # warm every kernel once at an unrelated length (library loading is not a per-length cost)
    q = bhsd(32, 64)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.ops.aten._scaled_dot_product_cudnn_attention(q, q, q, None, True)
    torch.ops.aten._scaled_dot_product_flash_attention(q, q, q)
    torch.cuda.synchronize()

    def prefill_args(length):
        return bhsd(32, length), bhsd(32, length), bhsd(32, length)

    def masked(q, k, v):
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril().to(device)[None, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    measure("dit_prefill", prefill_args, masked, fresh_lengths(), kernel="sdpa default, bool mask")
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip

        def causal(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        measure("dit_prefill", prefill_args, causal, fresh_lengths(), kernel=f"{name}, is_causal")

        def masked_forced(q, k, v, backend=backend):
            with sdpa_kernel([backend]):
                return masked(q, k, v)

        measure("dit_prefill", prefill_args, masked_forced, fresh_lengths(), kernel=f"{name}, bool mask")

    def decode_args(length):
        return bhsd(32, 4096), bhsd(32, length), bhsd(32, length)

    measure("dit_decode_prefix", decode_args,
            lambda q, k, v: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True),
            fresh_lengths(), kernel="cudnn, lse")  # fmt: skip
    measure("dit_decode_prefix", decode_args,
            lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v),
            fresh_lengths(), kernel="flash, lse")  # fmt: skip

    def encoder_args(length):
        return bhsd(32, length), bhsd(8, length), bhsd(8, length)

    def gqa(q, k, v, backend=None):
        with sdpa_kernel([backend]) if backend is not None else torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    measure("text_encoder", encoder_args, gqa, fresh_lengths(), kernel="sdpa default, is_causal, gqa")
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):  # fmt: skip
        measure("text_encoder", encoder_args, lambda q, k, v, b=backend: gqa(q, k, v, b), fresh_lengths(),
                kernel=f"{name}, is_causal, gqa")  # fmt: skip

        def repeated(q, k, v, backend=backend):  # transformers' path without enable_gqa: K/V repeated to 32 heads
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                      is_causal=True)  # fmt: skip

        measure("text_encoder", encoder_args, repeated, fresh_lengths(), kernel=f"{name}, is_causal, kv repeated")
    # at a repeated shape, the decode step's two halves at the sizes users meet: is flash as fast as cuDNN there?
    for label, queries, keys in (("1024^2 target", 4096, 4096), ("1536^2 target", 9216, 9216),
                                 ("1024^2 over a 1-reference prefix", 4096, 4196),
                                 ("1024^2 over a 4-reference prefix", 4096, 16484)):  # fmt: skip
        q, k, v = bhsd(32, queries), bhsd(32, keys), bhsd(32, keys)
        times = {}
        kernels = {"cudnn": lambda q, k, v: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True),
                   "flash": lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)}  # fmt: skip
        for name, kernel in kernels.items():
            op = functools.partial(kernel, q, k, v)
            op()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(20):
                op()
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - started) / 20 * 1e3
        emit(what="attention_repeat", case=label, queries=queries, keys=keys, cudnn_ms=round(times["cudnn"], 4),
             flash_ms=round(times["flash"], 4), flash_over_cudnn=round(times["flash"] / times["cudnn"], 3))  # fmt: skip
    emit(what="attention_length_setup", torch=torch.__version__, device=torch.cuda.get_device_name(),
         cudnn=torch.backends.cudnn.version())  # fmt: skip


if __name__ == "__main__":
    main()
