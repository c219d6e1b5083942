"""Per-layer data that lives in pinned host memory, brought to the device just ahead of use.

`SlotPrefetcher` owns `slots` device buffers at fixed addresses. Items (one flat pinned uint8 buffer per layer,
in the order the layers run) are copied into the slots on a side stream: the first `slots` at `begin()`, then
item k + slots as soon as item k's layer is done with its slot (`release`). `acquire(index)` makes the compute
stream wait for that item's copy and returns its slot. So while layer i computes, the next layers' data crosses
PCIe, and the addresses never change: a captured CUDA graph replays the copies, waits and kernels as they were.

On a CPU device (tests) copies are immediate; `log` records every copy as (index, slot) either way.
"""

from __future__ import annotations

import torch


class SlotPrefetcher:
    def __init__(self, device: torch.device, slot_bytes: int, slots: int = 2):
        if slots < 1:
            raise ValueError(f"a prefetcher needs at least one slot, got {slots}")
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        with torch.inference_mode(False):  # buffers may outlive this call inside a captured graph
            self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(slots)]
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.order: list[int] = []
        self.host: dict[int, torch.Tensor] = {}
        self._ready: dict[int, torch.cuda.Event] = {}
        self._free: list[torch.cuda.Event | None] = [None] * slots
        self.log: list[tuple[int, int]] = []

    @property
    def slots(self) -> int:
        return len(self.buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def set_items(self, host: dict[int, torch.Tensor]) -> None:
        """The items to stream: layer index -> pinned flat uint8 host buffer; they run in ascending index order."""
        too_big = [i for i, buffer in host.items() if buffer.numel() > self.buffers[0].numel()]
        if too_big:
            raise ValueError(f"items {too_big[:3]} are larger than a slot ({self.buffers[0].numel()} bytes)")
        self.host = dict(host)
        self.order = sorted(host)

    def slot_of(self, index: int) -> int:
        return self.order.index(index) % self.slots

    def begin(self) -> None:
        """Start a pass: copy the first items, after whatever the compute stream did before (the last pass)."""
        if self.cuda and self.order:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._free = [None] * self.slots
        for position in range(min(self.slots, len(self.order))):
            self._copy(self.order[position])

    def acquire(self, index: int) -> torch.Tensor:
        """The slot holding item `index`, once its copy is done (the compute stream waits for it, not the host)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[index])
        return self.buffers[self.slot_of(index)]

    def release(self, index: int) -> None:
        """Layer `index` is done with its slot: refill the slot with the item `slots` positions later."""
        slot = self.slot_of(index)
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._free[slot] = event
        position = self.order.index(index) + self.slots
        if position < len(self.order):
            self._copy(self.order[position])

    def _copy(self, index: int) -> None:
        slot = self.slot_of(index)
        source = self.host[index]
        target = self.buffers[slot][: source.numel()]
        self.log.append((index, slot))
        if not self.cuda:
            target.copy_(source)
            return
        with torch.cuda.stream(self.stream):
            if self._free[slot] is not None:
                self.stream.wait_event(self._free[slot])
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._ready[index] = event
