"""The one memory adapter: how our models are registered with a memory manager, for our own nodes and for the
MODEL that KSampler drives alike.

Inside ComfyUI every component (DiT, text encoder, VAE) is a ModelPatcher of ours (nodes/comfy/patcher.py, as
ComfyUI-GGUF's GGUFModelPatcher is one) registered with ComfyUI's model management: it counts their VRAM, evicts other
models for them, moves them off when others need the room (a streamable stack partly: its other layers stream from
pinned RAM) and `POST /free` unloads them. The DiT's patcher wraps `Qwen21ComfyModel` (nodes/comfy/model.py), which is
also the MODEL output: the weights KSampler runs are the ones our sampler runs, with ComfyUI's LoRA patches merged
through our merge. Outside ComfyUI the local manager (qwen21_core/memory/manager.py) places them on the same terms,
within `--vram-budget`. The rules themselves (how many layers fit, what a device holds, the out-of-memory retry) are
qwen21_core/memory/'s; this module only says which manager applies them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from ..qwen21_core.memory import planner
from ..qwen21_core.memory.manager import (  # noqa: F401 - the nodes' one door to the memory rules
    TEXT_ENCODER_OFFLOAD,
    LocalMemoryManager,
    component_devices,
    encoder_runs_in_place,
    evictable,
    expected_kv_placement,
    offload_after_encode,
    own_gpu,
    text_encoder_load_device,
    text_encoder_offload,
)
from ..qwen21_core.memory.out_of_memory import SMALLER_PLAN_FACTOR
from ..qwen21_core.memory.sizing import job_bytes  # noqa: F401 - for the MODEL's memory_required
from ..qwen21_core.memory.streaming import StreamableStack
from ..qwen21_core.quant.gguf_prefetch import gguf_transient_bytes  # noqa: F401 - for memory_required too
from . import host

log = logging.getLogger(__name__)

LOCAL = LocalMemoryManager()  # outside ComfyUI: places our models


def set_vram_budget(budget_bytes: int | None) -> None:
    """Outside ComfyUI: cap the device memory our models and caches plan with (None: the whole device)."""
    LOCAL.budget = None if budget_bytes is None else int(budget_bytes)


class _ComfyManaged:
    """The memory side of a pipeline inside ComfyUI: ComfyUI's manager places the weights and decides what is free
    (no budget of ours)."""

    budget = None
    places_weights = False


def pipeline_memory():
    """What our handles' pipelines plan with (`pipe.memory`): the local manager, whose budget is --vram-budget, or
    inside ComfyUI its manager's terms."""
    return _ComfyManaged() if host.IN_COMFYUI else LOCAL


def device_capacity_bytes(device: torch.device) -> int:
    """All the memory our models may have on `device`: ComfyUI's total VRAM, or the local budget / device size."""
    device = planner.indexed_device(device)
    if host.IN_COMFYUI and device.type == "cuda":
        return planner.device_capacity_bytes(device, manager_total=host.comfy_mm.get_total_memory(device))
    return planner.device_capacity_bytes(device, LOCAL.budget)


@contextlib.contextmanager
def smaller_plan(device: torch.device, needed: int):
    """Less memory planned for a retry after an out-of-memory error: inside ComfyUI its manager frees other models
    (more than the run asked for); outside, the local budget is lowered by a fifth for the retry (the manager places
    fewer blocks, the planner keeps more of the K/V cache in host RAM)."""
    if host.IN_COMFYUI:
        host.comfy_mm.free_memory(int(needed / SMALLER_PLAN_FACTOR), device)
        yield
        return
    saved = LOCAL.budget
    LOCAL.budget = int((saved if saved is not None else device_capacity_bytes(device)) * SMALLER_PLAN_FACTOR)
    try:
        yield
    finally:
        LOCAL.budget = saved


def working_memory_request(candidates: list[int], device, weights_bytes: int) -> int:
    """Bytes of working memory to ask the manager for beside a model of `weights_bytes` (a VAE decode's untiled pass):
    inside ComfyUI the first of `candidates` that the device could hold with it, so that ComfyUI frees idle models'
    layers (partly: the text encoder's after sampling) as for its own VAE Decode, rather than the pass tiling; 0 where
    none could (the pass tiles, nothing is evicted for it). 0 outside ComfyUI too: the local manager moves whole
    models off, and the encoder's reload at the next prompt would cost more than the tiles."""
    device = planner.indexed_device(device)
    if not host.IN_COMFYUI or device.type != "cuda":
        return 0
    room = device_capacity_bytes(device) - int(weights_bytes)
    return next((int(needed) for needed in candidates if needed <= room), 0)


def _new_patcher(make_model, managed, load_device, offload_device):
    from .comfy.patcher import new_patcher  # imports ComfyUI: inside it only

    return new_patcher(make_model(), managed, load_device, offload_device)


class Qwen21Weights(torch.nn.Module):
    """What a patcher of the text encoder or VAE manages: our modules as children, plus the plain `device`
    attribute ModelPatcher writes (transformers models have a read-only `device` property)."""

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self.device = device


class ManagedModules:
    """Modules registered with a memory manager: ComfyUI's inside ComfyUI, the local one outside (see the module
    docstring). `on_unload` runs whenever they are really unloaded (free caches tied to them).

    `streamable` (the DiT, the text encoder) is the object that can run with only part of its layer stack on the
    device (`place(device, resident_layers)`, `layer_bytes`, `num_layers`, `device_weight_bytes()`): for it a
    partial load is honoured, the other layers stream from pinned host RAM. Other modules load whole.
    `evictable` False keeps the local manager from moving them off for another model (the text encoder with
    offload_text_encoder "never"); ComfyUI's manager has no such setting.
    `comfy_model`: inside ComfyUI, makes the model the patcher wraps (the DiT's `Qwen21ComfyModel`, the MODEL);
    others are wrapped in a plain `Qwen21Weights`.
    `merge_loras` (the DiT's): brings the weights to a LoRA stack once they are placed; `loras` is this handle's
    stack (`with_loras`). Inside ComfyUI the patcher does it as part of loading, with ComfyUI's own patches after
    ours, through the same call.
    `runs_in_place` (the text encoder's): inside ComfyUI, on a GPU where part of it is loaded already, it runs as it
    is (memory/manager.py encoder_runs_in_place) rather than making the manager evict the DiT for it.
    """

    def __init__(
        self,
        modules: dict[str, torch.nn.Module],
        load_device: torch.device,
        on_unload: Callable[[], None] | None = None,
        streamable: StreamableStack | None = None,
        comfy_model: Callable[[], torch.nn.Module] | None = None,
        merge_loras: Callable[[tuple], None] | None = None,
    ):
        self.modules = modules
        self.load_device = torch.device(load_device)
        self.streamable = streamable
        self.on_unload = on_unload
        self.merge_loras = merge_loras
        self.loras: tuple = ()
        self.full_bytes = sum(p.numel() * p.element_size() for m in modules.values() for p in m.parameters())
        self.name = "+".join(modules)  # for logs: "transformer", "text_encoder", "vae"
        self.evictable = True
        self.runs_in_place = False
        self.patcher = None
        if host.IN_COMFYUI:
            make = comfy_model or (lambda: Qwen21Weights(modules, host.offload_device()))
            self.patcher = _new_patcher(make, self, load_device, host.offload_device())

    def with_loras(self, stack: tuple) -> ManagedModules:
        """The same modules for a handle whose DiT runs with the LoRA `stack`: inside ComfyUI a clone of the patcher
        carrying it (ComfyUI sees other weights, and merging them is part of loading)."""
        clone = object.__new__(ManagedModules)
        clone.__dict__.update(self.__dict__)
        clone.loras = tuple(stack)
        if self.patcher is not None:
            clone.patcher = self.patcher.clone_with_loras(clone.loras)
        return clone

    def load(self, memory_required: int = 0, companions: tuple = ()) -> None:
        """Put the modules on their device (partly, for a streamable stack that does not fit), evicting other
        models if needed, and bring the DiT's weights to this handle's LoRA stack. companions: other ManagedModules
        that run with these (a control branch beside the DiT), placed in the same call, never evicted for these."""
        if self.patcher is not None:
            if not companions and self._runs_in_place_now(int(memory_required)):
                return
            patchers = [self.patcher, *(c.patcher for c in companions)]
            host.comfy_mm.load_models_gpu(patchers, memory_required=int(memory_required),
                                          force_full_load=self.streamable is None)  # fmt: skip
            return
        for companion in companions:  # first, leaving room for these whole where the device has it
            LOCAL.load(companion, int(memory_required) + self.full_bytes)
        kept = [(companion, companion.evictable) for companion in companions]
        for companion, _ in kept:
            companion.evictable = False
        try:
            LOCAL.load(self, int(memory_required))
        finally:
            for companion, evictable in kept:
                companion.evictable = evictable
        if self.merge_loras is not None:
            self.merge_loras(self.loras)  # after placing: merging runs where the weights are

    def _runs_in_place_now(self, memory_required: int) -> bool:
        if not self.runs_in_place or self.streamable is None or self.load_device.type != "cuda":
            return False
        free, on_device = host.comfy_mm.get_free_memory(self.load_device), self.device_bytes()
        margin = getattr(host.comfy_mm, "minimum_inference_memory", lambda: 2**30)()  # every release we read has it
        if not encoder_runs_in_place(on_device, free, memory_required, int(margin)):
            return False
        log.info("qwen21: %s runs where it is (%.2f of %.2f GiB on %s, the rest streamed; %.2f GiB free)", self.name,
                 on_device / 2**30, self.full_bytes / 2**30, self.load_device, free / 2**30)  # fmt: skip
        return True

    def unload(self) -> None:
        """Move the modules off their device now (as ComfyUI does when it needs the room)."""
        if self.patcher is None:
            LOCAL.offload(self)
            return
        unload_one = getattr(host.comfy_mm, "unload_model_and_clones", None)  # newer ComfyUI
        if unload_one is not None:
            unload_one(self.patcher, unload_additional_models=False)
        else:  # 0.3.64: ask its manager to free everything but the others
            others = [loaded for loaded in host.comfy_mm.current_loaded_models
                      if not loaded.model.is_clone(self.patcher)]  # fmt: skip
            host.comfy_mm.free_memory(1e30, self.patcher.load_device, keep_loaded=others)
        host.comfy_mm.soft_empty_cache()

    def released(self) -> None:
        """The modules left the device (the local manager calls it; ComfyUI's detach callback does the same)."""
        if self.on_unload is not None:
            self.on_unload()

    # ---- placement (the local manager and the ComfyUI patcher both come through here) ------------------------

    def device_bytes(self) -> int:
        if self.streamable is not None:
            return self.streamable.device_weight_bytes() if self._on(self.load_device) else 0
        return self.full_bytes if self._on(self.load_device) else 0

    def _on(self, device) -> bool:
        first = next((p for m in self.modules.values() for p in m.parameters()), None)
        if first is None:
            return False
        device = torch.device(device)
        return first.device == device or (first.device.type == device.type == "cuda"
                                          and device.index in (None, first.device.index))  # fmt: skip

    def place(self, device, resident_layers: int | None = None) -> None:
        if self.streamable is not None:
            self.streamable.place(device, resident_layers)
        else:
            for module in self.modules.values():
                module.to(device)

    def resident_for(self, weight_budget: int) -> int | None:
        """How many layers of the streamable stack fit `weight_budget` bytes of weights (None: all of them)."""
        if self.streamable is None:
            return None
        s = self.streamable
        return planner.resident_layers(weight_budget, self.full_bytes, s.layer_bytes, s.num_layers)
