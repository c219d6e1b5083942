"""Where the DiT, the text encoder and the VAE live outside ComfyUI, and when the text encoder leaves the GPU: the one
place that decides their residency (inside ComfyUI its memory manager decides, on the same terms).

`LocalMemoryManager` is ComfyUI's policy in small: before a model runs, the least recently used others that may be
evicted move off the device until it fits; a streamable one (DiT blocks, text-encoder layers) that still does not
fit runs with part of its layers streaming from host RAM. "Fits" is the device's free memory (memory/planner.py:
a per-process cap and a `--vram-budget` included) plus what the model already holds there, less what the run
needs beside its weights (`memory_required`: the K/V cache and activations of a sampling run, an encode's
activations).

The text encoder's residency (`TEXT_ENCODER_OFFLOAD`, the loaders' `offload_text_encoder`):
- "auto" (default): it stays on the GPU after encoding and leaves only when another model needs the room (it is
  evictable, least recently used first): on a card where the run's sampling fits beside it a changed prompt never
  moves it; on a small card it leaves for the DiT and comes back from its pinned host copy (memory/host_copy.py);
- "always": it leaves right after every encode (the old default: the most room for the DiT, a move per prompt);
- "never": it is not evicted by this manager (the DiT streams blocks instead); inside ComfyUI its manager can still
  move it off when another model needs the room.
An encoder on a GPU of its own (the loaders' text_encoder_device) stays there whatever the choice.
Saved workflows from before this choice have a boolean: True meant "always", False "never".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from . import planner

log = logging.getLogger(__name__)

TEXT_ENCODER_OFFLOAD = ("auto", "always", "never")


def text_encoder_offload(value) -> str:
    """The residency choice from a loader input: one of TEXT_ENCODER_OFFLOAD, or a saved workflow's boolean."""
    if isinstance(value, bool):
        return "always" if value else "never"
    if value in TEXT_ENCODER_OFFLOAD:
        return value
    raise ValueError(f"offload_text_encoder must be one of {list(TEXT_ENCODER_OFFLOAD)} (or true / false from an "
                     f"older workflow), got {value!r}")  # fmt: skip


ENCODE_ROOM_FACTOR = 1.15  # the weights plus an encode's activations and the allocator's slack, about


def text_encoder_load_device(target: torch.device, free_bytes: int, encoder_bytes: int) -> torch.device:
    """Where a loader reads the text encoder's weights to: the GPU it runs on when they fit there beside what is
    loaded already, else the CPU, from where the memory manager brings the encoder on first use. A card too small
    for the DiT and the encoder together (fp8: 6.76 + 8.71 GiB on a 12 or 16 GB card) would otherwise run out of
    memory while loading, before any manager could decide anything."""
    if target.type != "cuda" or free_bytes >= encoder_bytes * ENCODE_ROOM_FACTOR + planner.HEADROOM_BYTES:
        return target
    return torch.device("cpu")


def offload_after_encode(choice: str, own_gpu: bool = False) -> bool:
    """Whether the encoder leaves right after an encode: with "always", unless it runs on a GPU of its own (another
    than the DiT's, chosen in the loader), where nothing else needs its room."""
    return choice == "always" and not own_gpu


def evictable(choice: str) -> bool:
    """Whether a memory manager may move the text encoder off to make room for another model."""
    return choice != "never"


class Managed(Protocol):
    """What the manager needs of a model (nodes/host.py ManagedModules provides it)."""

    name: str
    load_device: torch.device
    full_bytes: int
    evictable: bool

    def device_bytes(self) -> int: ...

    def resident_for(self, weight_budget: int) -> int | None: ...

    def place(self, device, resident_layers: int | None = None) -> None: ...

    def released(self) -> None: ...


@dataclass
class OwnPlacement:
    """The memory side of a pipeline used on its own (scripts, tests, benchmarks): it places its weights itself
    (streaming DiT blocks when they do not fit), within `budget` bytes of the device (None: what it has)."""

    budget: int | None = None
    places_weights: bool = True


class LocalMemoryManager:
    """Outside ComfyUI, with our nodes: places our models (see the module docstring). It is also the memory side of
    their pipeline (`pipe.memory`): its `budget` (the runner's --vram-budget) bounds everything a run plans, weights,
    K/V caches, the prefix check, LoRA copies and prefill graphs alike."""

    places_weights = False  # a manager places them: the pipeline plans only around them

    def __init__(self, offload_device: torch.device | str = "cpu"):
        self.budget: int | None = None  # bytes our models and caches may use on the device; None: what it has
        self.offload_device = torch.device(offload_device)
        self.loaded: list[Managed] = []  # least recently used first

    def load(self, managed: Managed, memory_required: int) -> None:
        """Put `managed` on its device (partly, if even after evictions it does not fit whole), `memory_required`
        bytes left free beside its weights."""
        device = managed.load_device
        if device.type != "cuda":
            return
        if managed in self.loaded:
            self.loaded.remove(managed)

        def room():
            free = planner.device_free_bytes(device, self.budget)
            return free + managed.device_bytes() - memory_required - planner.HEADROOM_BYTES

        # by GPU, not by spelling: an encoder's device comes from its weights ("cuda:0"), a handle's may be "cuda"
        for other in [m for m in self.loaded if m.evictable and planner.same_device(m.load_device, device)]:
            if room() >= managed.full_bytes:
                break
            log.info("memory manager: moving %s off %s to make room for %s", other.name, device, managed.name)
            self.offload(other)
        free = room()  # one reading (each takes an allocator snapshot)
        resident = None if free >= managed.full_bytes else managed.resident_for(free)
        self.loaded.append(managed)
        if resident is None and managed.device_bytes() >= managed.full_bytes:
            return  # already whole there: every encode and sample asks, and walking the weights costs time
        log.info("memory manager: %s on %s (%s; %.2f GiB of weights, %.2f GiB more needed, %.2f GiB free)",
                 managed.name, device, "whole" if resident is None else f"{resident} layers resident",
                 managed.full_bytes / 2**30, memory_required / 2**30, free / 2**30)  # fmt: skip
        managed.place(device, resident)

    def offload(self, managed: Managed) -> None:
        managed.place(self.offload_device)
        if managed in self.loaded:
            self.loaded.remove(managed)
        managed.released()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
