"""Pinned host buffers for host-placed K/V caches, kept after a generation for the next one.

Where the prefix K/V does not fit the card (an edit with several references at 16 or 12 GB), it lives in pinned host
RAM, and pinning is slow (bench_copy_rates measures it); an edit with several references at a 12 GB cap paid it again at
every prompt (bench_session's `branch_setup_s`). torch keeps a freed pinned block for a later request of the same
power-of-two size, but any pinned request of that size may take it (a LoRA's kept originals, a model's host copy), and
then the next edit pins again. So released K/V buffers are kept here, for K/V caches only: a request takes the smallest
kept buffer it fits in. A new buffer is pinned `HEADROOM` larger than asked: the next edit's prompt is other text, a few
tokens longer or shorter, and a buffer one token short is of no use (for a large edit's cache, 1/32 is hundreds of
tokens). At most `MAX_KEPT` (a CFG run has two branches), and only while host RAM has at least as much again available
(`memory/planner.host_free_bytes`): a kept buffer is RAM that other pinned requests can no longer take from torch's
cache, so on a machine short of RAM the buffers go back to torch, as before. None after `clear` (the pipeline's full
release, an out-of-memory retry, and when a pipeline is freed); a DiT moved off the device keeps them (memory manager
unloads at a cap happen every prompt).
"""

from __future__ import annotations

import threading

import torch

from .planner import host_free_bytes

MAX_KEPT = 2
HEADROOM = 1 / 32  # a new buffer's extra size, for the next cache's longer prompt


class PinnedBuffers:
    def __init__(self, max_kept: int = MAX_KEPT):
        self.max_kept = max_kept
        self._kept: list[torch.Tensor] = []  # flat uint8 buffers no cache uses, smallest first
        self._lock = threading.Lock()
        self.reused = 0  # requests served from a kept buffer

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A flat uint8 host buffer of `nbytes`, pinned for a CUDA `device`: a view of a kept buffer where one is
        large enough, else a view of a new one with `HEADROOM` more. A kept buffer may still be read by work queued
        on the device (the last generation's copies): the device is synchronised before it is handed out again."""
        with self._lock:
            fitting = next((b for b in self._kept if b.numel() >= nbytes), None)
            if fitting is not None:
                self._kept.remove(fitting)
                self.reused += 1
        if fitting is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return fitting[:nbytes]
        with torch.inference_mode(False):
            pinned = torch.empty(nbytes + int(nbytes * HEADROOM), dtype=torch.uint8, pin_memory=device.type == "cuda")
        return pinned[:nbytes]

    def give_back(self, buffer: torch.Tensor) -> None:
        """Keep `buffer` (one `take` gave, or a view of it) for a later request: the largest `max_kept` are kept,
        none unless host RAM has at least its size again available (they go back to torch's cache of pinned blocks,
        where any pinned request may reuse them)."""
        base = buffer if buffer._base is None else buffer._base
        available = host_free_bytes()
        with self._lock:
            if available is not None and available < base.numel():
                self._kept.clear()
                return
            self._kept = sorted([*self._kept, base], key=lambda b: b.numel())[-self.max_kept :] if self.max_kept else []

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._kept)


HOST_KV_BUFFERS = PinnedBuffers()  # one per process: a host K/V cache may come from any pipeline
