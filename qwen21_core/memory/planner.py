"""How much device memory there is to plan with, and where the DiT's blocks and prefix K/V go within it.

Free memory is the smallest of: what the device reports free (plus this process's cached blocks, but not those
held in CUDA graphs' private pools), what a per-process cap leaves (`torch.cuda.set_per_process_memory_fraction`,
the stand-in for a smaller card) and an explicit budget (`--vram-budget`, or ComfyUI's decision), minus what this
process already allocated against either.

`plan_sampling` decides, for one sample call, in this order (each step only when the previous does not fit):
1. everything on the device: all DiT blocks resident, the prefix K/V on the GPU;
2. the prefix K/V in pinned host RAM (prefetched a layer ahead; about free for text-to-image, whose prefix is
   small, and PCIe-bound for big reference prefixes);
3. fewer resident DiT blocks: the rest stream from pinned host RAM through two staging slots.
Always needed: the non-block weights, the activations of a step and the K/V working buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import stable_name

HEADROOM_BYTES = 512 * 2**20  # fragmentation and small allocations the estimates do not see
DECODE_HEADROOM_BYTES = 2 * 2**30  # activations of a decode step at 2048^2 stay below this (bf16)


def indexed_device(device) -> torch.device:
    """`device` with its index: some torch.cuda queries (the per-process fraction) refuse a bare "cuda", which means
    the current GPU (index 0 where torch sees none: names compare the same on a machine without a GPU)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def same_device(a, b) -> bool:
    """Whether two device names mean one device ("cuda" and "cuda:0" on a process whose current GPU is 0)."""
    return indexed_device(a) == indexed_device(b)


# What the allocator has done so far on a device: if none of these moved, no block was allocated or freed in any pool,
# so the last snapshot still holds. The current values guard against a reset of the cumulative counts.
_ALLOCATOR_ACTIVITY = ("allocation.all.allocated", "allocation.all.freed", "segment.all.allocated",
                       "segment.all.freed", "allocated_bytes.all.current", "reserved_bytes.all.current")  # fmt: skip
_pool_snapshots: dict[int, tuple[tuple[int, ...], dict[tuple[int, int], int]]] = {}


def graph_pool_idle_bytes(device: torch.device) -> dict[tuple[int, int], int]:
    """Per CUDA-graph private pool on `device`: its reserved bytes no tensor uses. Only that graph's replays can use
    them (empty_cache cannot return them while the graph lives), so they are not free for anything else.

    It reads an allocator snapshot, which lists every segment (slow once graphs are alive, as a profile showed) and
    is asked several times per prompt (every placement decision): a snapshot is taken again only after the allocator
    did something (its cumulative counts, `memory_stats`, are cheap to read)."""
    device = indexed_device(device)
    if device.type != "cuda" or torch.cuda.get_allocator_backend() != "native":  # no graphs under cudaMallocAsync
        return {}
    stats = torch.cuda.memory_stats(device)
    activity = tuple(stats.get(name, 0) for name in _ALLOCATOR_ACTIVITY)
    kept = _pool_snapshots.get(device.index)
    if kept is not None and kept[0] == activity:
        return dict(kept[1])
    pools: dict[tuple[int, int], int] = {}
    for segment in torch.cuda.memory_snapshot():
        pool = tuple(segment.get("segment_pool_id") or (0, 0))
        if pool != (0, 0) and segment.get("device") == device.index:
            pools[pool] = pools.get(pool, 0) + segment["total_size"] - segment["allocated_size"]
    _pool_snapshots[device.index] = (activity, pools)
    return dict(pools)


def device_free_bytes(device: torch.device, budget: int | None = None) -> int:
    """Bytes this process can still allocate on `device` (see the module docstring); CPU: unlimited."""
    device = indexed_device(device)
    if device.type != "cuda":
        return 2**62
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    # cached blocks are ours to reuse, except those in CUDA graphs' private pools
    free += reserved - torch.cuda.memory_allocated(device) - sum(graph_pool_idle_bytes(device).values())
    limits = [free]
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction < 1.0:
        limits.append(int(fraction * total) - torch.cuda.memory_allocated(device))
    if budget is not None:
        limits.append(budget - torch.cuda.memory_allocated(device))
    return max(0, min(limits))


def device_capacity_bytes(device, budget: int | None = None, manager_total: int | None = None) -> int:
    """All the memory our models may have on `device`: what a memory manager says the device has (ComfyUI's total,
    which --reserve-vram lowers), else the device's size under a per-process cap, and within `budget`."""
    device = indexed_device(device)
    if device.type != "cuda":
        return 2**62
    if manager_total is not None:
        total = int(manager_total)
    else:
        total = torch.cuda.get_device_properties(device).total_memory
        total = int(total * torch.cuda.get_per_process_memory_fraction(device))
    return total if budget is None else min(total, int(budget))


def resident_layers(weight_budget: int, full_bytes: int, layer_bytes: int, num_layers: int) -> int | None:
    """How many layers of a streamable stack (full_bytes in all, num_layers of layer_bytes) fit `weight_budget`
    bytes of weights on the device (None: all of them). Its other weights and two staging slots come first."""
    if weight_budget >= full_bytes:
        return None
    fixed = full_bytes - num_layers * layer_bytes + 2 * layer_bytes
    return max(0, min(num_layers, (weight_budget - fixed) // max(1, layer_bytes)))


HOST_RESERVE_BYTES = 4 * 2**30  # RAM left to the OS, ComfyUI and the models it parks there


def host_free_bytes() -> int | None:
    """RAM a host-placed K/V cache may still pin: what the OS calls available, less HOST_RESERVE_BYTES; None where
    it cannot be read (no psutil, which ComfyUI requires, and no /proc/meminfo)."""
    try:
        import psutil  # optional: a ComfyUI requirement, not ours
    except ImportError:
        available = _meminfo_available_bytes()
    else:
        available = psutil.virtual_memory().available
    return None if available is None else max(0, int(available) - HOST_RESERVE_BYTES)


def _meminfo_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


KEPT_COPIES_SHARE = 0.5  # of the device's free memory, what long-lived copies beside the weights may take


def copies_place(nbytes: int, device, budget: int | None = None) -> str:
    """Where `nbytes` of long-lived copies of a model's weights go (a LoRA merge's originals, lora/merge.py
    MemoryOriginals): "device" when the weights are on a CUDA device and the copies take at most KEPT_COPIES_SHARE
    of what device_free_bytes(device, budget) leaves beyond HEADROOM_BYTES (sampling keeps the larger part of the
    free memory; putting a weight back is then a copy within the device); else "pinned" host RAM when
    host_free_bytes holds them (copies at the bus's rate, but pinning is slow, paid once); else
    "pageable" host RAM (also the place for weights on the CPU)."""
    device = indexed_device(device)
    if device.type != "cuda":
        return "pageable"
    if nbytes <= KEPT_COPIES_SHARE * (device_free_bytes(device, budget) - HEADROOM_BYTES):
        return "device"
    host = host_free_bytes()
    return "pinned" if host is None or nbytes <= host else "pageable"


@dataclass(frozen=True)
class SamplingPlan:
    kv_placement: str  # "gpu" | "cpu"
    resident_blocks: int  # DiT blocks kept on the device; the others stream
    reason: str


@stable_name
class DeviceMemoryError(MemoryError):
    """Even with every block streaming and the K/V cache in host RAM, one step does not fit the device."""


def plan_sampling(budget: int, cache_bytes: dict, activation_bytes: int, block_bytes: int, num_blocks: int,
                  slot_bytes: int, placement: str = "auto") -> SamplingPlan:  # fmt: skip
    """Where the prefix K/V go and how many DiT blocks stay resident.

    budget: device bytes for the DiT's blocks and this call's job (the free memory plus what the currently resident
    blocks occupy); cache_bytes: K/V placement ("gpu"/"cpu") -> the branches' device bytes; block_bytes: one
    block's weights; slot_bytes: the staging slots streaming needs; placement: "auto" or a forced "gpu"/"cpu".
    """
    usable = budget - HEADROOM_BYTES
    choices = ["gpu", "cpu"] if placement == "auto" else [placement]
    for kv in choices:
        if num_blocks * block_bytes + cache_bytes[kv] + activation_bytes <= usable:
            return SamplingPlan(kv, num_blocks, f"K/V cache on {kv}, all {num_blocks} blocks resident")
    kv = choices[-1]
    left = usable - cache_bytes[kv] - activation_bytes - slot_bytes
    resident = min(num_blocks, left // max(1, block_bytes))
    if resident < 0:
        need = cache_bytes[kv] + activation_bytes + slot_bytes + HEADROOM_BYTES
        raise DeviceMemoryError(
            f"one step needs {need / 2**30:.2f} GiB of device memory even with every DiT block streamed "
            f"(K/V cache on {kv}: {cache_bytes[kv] / 2**30:.2f} GiB, activations {activation_bytes / 2**30:.2f} GiB, "
            f"staging {slot_bytes / 2**30:.2f} GiB) but only {budget / 2**30:.2f} GiB is available. Lower the output "
            "size, the number of condition images or the batch, use an fp8/int8 K/V cache, or free GPU memory."
        )
    return SamplingPlan(
        kv, int(resident), f"K/V cache on {kv}, {num_blocks - resident} of {num_blocks} blocks streamed"
    )


def plan_for_transformer(transformer, device: torch.device, budget: int | None, idle_bytes: int, cache_bytes: dict,
                         activation_bytes: int, places_weights: bool, placement: str = "auto") -> SamplingPlan:
    """`plan_sampling` for `transformer` as it is placed now on `device`, within `budget`. idle_bytes: K/V caches kept
    from the previous run that this one gets back (a graph entry adopted, or evicted when an allocation runs out);
    counted as taken, a rerun with a new seed would move its K/V to host RAM. places_weights False: a memory manager
    placed the blocks, so they are not ours to plan; only the K/V placement is, beside the blocks resident now (and
    the staging slots, if some stream)."""
    blocks = len(transformer.transformer_blocks)
    if device.type != "cuda":
        return SamplingPlan("gpu", blocks, "not on CUDA: everything where it is")
    block_bytes, resident, streamer = transformer.layer_bytes, transformer.resident_blocks, transformer.streamer
    slot_bytes = (streamer.slot_bytes if streamer is not None else 0) or 2 * block_bytes
    room = device_free_bytes(device, budget) + idle_bytes + resident * block_bytes
    if places_weights:
        return plan_sampling(room, cache_bytes, activation_bytes, block_bytes, blocks, slot_bytes, placement)
    staging = slot_bytes if resident < blocks else 0
    plan = plan_sampling(room, cache_bytes, activation_bytes + staging, block_bytes, resident, 0, placement)
    placed = "all" if resident == blocks else f"{resident} of"
    return SamplingPlan(plan.kv_placement, resident, f"K/V cache on {plan.kv_placement}, {placed} {blocks} blocks "
                        "resident (placed by the memory manager)")  # fmt: skip
