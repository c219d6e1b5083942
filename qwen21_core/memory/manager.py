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

import contextlib
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


# The room a text encoder needs on a GPU: its weights, an encode's activations and the allocator's slack, about.
ENCODER_ROOM_FACTOR = 1.25


def component_devices(dit: torch.device, text_encoder: str, vae: str, gpu_bytes: list[int], encoder_bytes: int = 0):
    """(text encoder device, VAE device) for the loaders' choices. "auto" puts the text encoder on the first GPU
    other than the DiT's whose memory (gpu_bytes: each GPU's total) holds it with room to spare, else with the DiT;
    the VAE with the DiT."""
    others = [torch.device("cuda", i) for i, total in enumerate(gpu_bytes)
              if (dit.type != "cuda" or i != dit.index) and total >= ENCODER_ROOM_FACTOR * encoder_bytes]  # fmt: skip
    if text_encoder == "auto":
        text_encoder_device = others[0] if dit.type == "cuda" and others else dit
    else:
        text_encoder_device = torch.device(text_encoder)
    return text_encoder_device, dit if vae == "auto" else torch.device(vae)


def text_encoder_load_device(dit_device: torch.device, encoder_device: torch.device, dit_bytes: int,
                             encoder_bytes: int, budget: int | None = None) -> torch.device:  # fmt: skip
    """Where a loader reads the text encoder's weights to: the GPU it runs on when they fit there beside what is
    loaded already (and the DiT about to be read to the same GPU), else the CPU, from where the memory manager brings
    the encoder on first use. A card too small for the DiT and the encoder together would otherwise run out of
    memory while loading, before any manager could decide anything."""
    if encoder_device.type != "cuda":
        return encoder_device
    free = planner.device_free_bytes(encoder_device, budget)
    if planner.same_device(encoder_device, dit_device):
        free -= dit_bytes
    if free >= encoder_bytes * ENCODER_ROOM_FACTOR + planner.HEADROOM_BYTES:
        return encoder_device
    log.info("the text encoder (%.2f GiB) does not fit beside the DiT on %s (%.2f GiB free): read to the CPU, "
             "placed on first use", encoder_bytes / 2**30, encoder_device, max(free, 0) / 2**30)  # fmt: skip
    return torch.device("cpu")


def own_gpu(encoder_device, dit_device) -> bool:
    """Whether the text encoder runs on a GPU of its own (another than the DiT's): nothing else needs its room."""
    return torch.device(encoder_device).type == "cuda" and not planner.same_device(encoder_device, dit_device)


def leaves_for_sampling(choice: str, encoder_device, dit_device) -> bool:
    """Whether the text encoder's weights may leave the DiT's GPU for sampling (they count as free when the prefix
    memory is checked): any choice but "never", unless it has a GPU of its own."""
    return evictable(choice) and not own_gpu(encoder_device, dit_device)


def offload_after_encode(choice: str, encoder_device, dit_device) -> bool:
    """Whether the encoder leaves right after an encode: with "always", unless it runs on a GPU of its own (another
    than the DiT's, chosen in the loader), where nothing else needs its room."""
    return choice == "always" and not own_gpu(encoder_device, dit_device)


def encoder_runs_in_place(device_bytes: int, free_bytes: int, needed_bytes: int, margin_bytes: int) -> bool:
    """Inside ComfyUI, whether the text encoder runs with the layers it has on the device (the others streaming from
    pinned RAM) instead of asking the manager to load it whole. A load makes the manager evict the DiT's blocks for
    the encoder's missing layers, and sampling then evicts the encoder's for the DiT's: on a card that cannot hold
    both, every changed prompt moved both ways. Streaming moves only the encoder's missing layers, once, beside its
    compute. It needs some of the encoder on the device already (else the manager places it first) and the free
    memory its activations take, with the manager's own margin for a run."""
    return device_bytes > 0 and free_bytes >= needed_bytes + margin_bytes


def expected_kv_placement(option: str, dit_bytes: int, gpu_job_bytes: int, capacity: int) -> str:
    """The K/V placement to ask a memory manager's room for before sampling: "auto" counts the GPU when the whole DiT
    and a GPU cache fit the device at all (the manager then evicts other models for it), else host RAM."""
    if option != "auto":
        return option
    return "gpu" if dit_bytes + gpu_job_bytes <= capacity else "cpu"


@contextlib.contextmanager
def text_encoder_placed(encoder, device: torch.device, places_weights: bool, offload: bool):
    """The text encoder on `device` for the block, where the pipeline places its weights itself (`places_weights`),
    and offloaded after it if `offload` (from a GPU: a CPU encoder has nowhere to go). Under a memory manager it is
    left where the manager put it (perhaps with layers streaming)."""
    if encoder is None:
        raise RuntimeError("this pipeline was loaded without a text encoder (load_text_encoder=False)")
    if places_weights:
        encoder.to(device)
    try:
        yield
    finally:
        if offload and places_weights and device.type == "cuda":
            encoder.offload()


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
