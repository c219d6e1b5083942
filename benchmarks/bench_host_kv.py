"""A host-placed K/V cache made again: the kept pinned buffer (memory/pinned_buffers.py) against torch's own cache of
freed pinned blocks, in one process, with another pinned allocation of the same size class in between (what a
LoRA's kept originals or a model's host copy may take from torch's cache).

    python benchmarks/bench_host_kv.py                     # a CUDA GPU: the 4-reference 1024^2 edit's prefix
    python benchmarks/bench_host_kv.py --references 1

One `host_kv` line: the prefix's tokens and bytes, and per row (the buffer kept, then `max_kept=0`: torch's cache
only) the first cache's making (pinning), the other allocation's and the second cache's; torch's cache of freed
pinned blocks is emptied before each row, so a row does not find the other's blocks (the first version of this
script ran the rows the other way round without emptying it: its kept-buffer row found every block pinned).
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import emit

GIB = 2**30


def empty_host_cache() -> None:
    """Give torch's cached free pinned blocks back (a private call: where this torch has none, rows may share)."""
    torch.cuda.synchronize()
    release = getattr(torch._C, "_host_emptyCache", None)
    if release is not None:
        release()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--references", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_host_kv needs a CUDA GPU")
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.dit import kv_cache
    from qwen21_nodes.qwen21_core.memory.pinned_buffers import PinnedBuffers

    config = TransformerConfig()
    target = 64 * 64  # 1024^2
    prefix = args.references * target + 100  # each 1024^2 reference, and a 100-token prompt
    heads, head_dim = config.num_attention_heads, config.attention_head_dim

    def make() -> tuple[kv_cache.PrefixKVCache, float]:
        torch.cuda.synchronize()
        started = time.perf_counter()
        cache = kv_cache.PrefixKVCache(config.num_layers, 1, prefix, target, heads, head_dim, torch.bfloat16, "cuda",
                                       placement="cpu")  # fmt: skip
        return cache, time.perf_counter() - started

    out = {}
    for name, kept in (("with_kept_buffer", 2), ("without_kept_buffer", 0)):
        empty_host_cache()
        kv_cache.HOST_KV_BUFFERS = PinnedBuffers(max_kept=kept)
        cache, first_s = make()
        nbytes = cache.host_nbytes
        cache.release()
        del cache
        started = time.perf_counter()
        other = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # another pinned user, same size class
        other_s = time.perf_counter() - started
        cache, second_s = make()
        cache.release()
        kv_cache.HOST_KV_BUFFERS.clear()
        del cache, other
        out[name] = {"first_s": round(first_s, 3), "other_pinned_s": round(other_s, 3), "second_s": round(second_s, 3)}
    saved = out["without_kept_buffer"]["second_s"] - out["with_kept_buffer"]["second_s"]
    emit(what="host_kv", device=torch.cuda.get_device_name(), references=args.references, prefix_tokens=prefix,
         host_gib=round(nbytes / GIB, 2), **out, second_saved_s=round(saved, 3))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
