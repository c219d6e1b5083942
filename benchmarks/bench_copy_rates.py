"""Host <-> GPU copy rates and what new host memory costs: the facts behind where the pack keeps weight copies.

    python benchmarks/bench_copy_rates.py      # a CUDA GPU: one JSON line

Moves 2 GiB each way: a pinned allocation, copies into and out of it, a pageable buffer's first and second copy
(the first touches every page), an H2D copy from pageable memory, 64 pinned allocations of 32 MiB, a pinned 3 GiB
allocation and a 3.5 GiB one after it was freed (what a second host-placed K/V cache pays), registering an
already-touched pageable buffer with CUDA (cudaHostRegister), a copy into it, and a copy within the GPU. Used by
memory/host_copy.py (a pinned home made once, not per prompt) and lora/merge.py (where a LoRA merge keeps the
weights it changes, memory/planner.py copies_place).
"""

from __future__ import annotations

import time

import torch
from _common import emit

GIB = 2**30


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return result, round(time.perf_counter() - start, 4)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_copy_rates needs a CUDA GPU")
    n = 2 * GIB
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    out = {}
    pinned, out["pin_alloc_s"] = timed(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True))
    _, out["d2h_pinned_s"] = timed(lambda: pinned.copy_(src, non_blocking=True))
    _, out["h2d_pinned_s"] = timed(lambda: src.copy_(pinned, non_blocking=True))
    page, out["pageable_alloc_s"] = timed(lambda: torch.empty(n, dtype=torch.uint8))
    _, out["d2h_pageable_first_s"] = timed(lambda: page.copy_(src))
    _, out["d2h_pageable_again_s"] = timed(lambda: page.copy_(src))
    _, out["h2d_pageable_s"] = timed(lambda: src.copy_(page))
    _, out["pin_alloc_64x32MiB_s"] = timed(
        lambda: [torch.empty(32 * 2**20, dtype=torch.uint8, pin_memory=True) for _ in range(64)]
    )
    registered = torch.empty(n, dtype=torch.uint8)
    registered.fill_(0)
    _, out["host_register_touched_s"] = timed(lambda: torch.cuda.cudart().cudaHostRegister(registered.data_ptr(), n, 0))
    _, out["d2h_registered_s"] = timed(lambda: registered.copy_(src, non_blocking=True))
    # a host-placed K/V cache is pinned per generation: what a second one costs once the first was freed (torch's
    # host allocator keeps freed pinned blocks, by power-of-two size)
    first, out["pin_alloc_3GiB_s"] = timed(lambda: torch.empty(3 * GIB, dtype=torch.uint8, pin_memory=True))
    del first
    _, out["pin_alloc_3_5GiB_after_free_s"] = timed(
        lambda: torch.empty(7 * GIB // 2, dtype=torch.uint8, pin_memory=True)
    )
    within = torch.empty_like(src)
    _, out["d2d_s"] = timed(lambda: within.copy_(src))
    emit(what="copy_rates", **out, gib=n / GIB)


if __name__ == "__main__":
    main()
