"""What a run does when the device runs out of memory: one retry with less memory planned, then an error that says
what to lower. The policy lives here; what "less memory planned" means is the memory manager's (the local one lowers
its budget, ComfyUI's frees other models), handed in as a context."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

import torch

log = logging.getLogger(__name__)

T = TypeVar("T")

SMALLER_PLAN_FACTOR = 0.8  # the retry plans with a fifth less of the budget (more stays in host RAM)


def retry_out_of_memory(run: Callable[[], T], what: str, release: Callable[[], None],
                        smaller_plan: Callable[[], contextlib.AbstractContextManager]) -> T:  # fmt: skip
    """run(); on an out-of-memory error, once more after `release()` (what can be rebuilt: idle caches, graphs) inside
    `smaller_plan()`; a second one is a MemoryError naming `what` and what to lower."""
    try:
        return run()
    except torch.OutOfMemoryError:
        log.warning("out of GPU memory while %s; retrying once with a smaller memory budget", what)
    release()
    try:
        with smaller_plan():
            return run()
    except torch.OutOfMemoryError as error:
        release()
        raise MemoryError(
            f"out of GPU memory while {what}, also after a retry with a fifth less memory planned. Lower the "
            "output size, the number of condition images or the batch; use kv_cache fp8 or kv_placement cpu, "
            "weight_dtype fp8 or int8; or free GPU memory (close other models)."
        ) from error
