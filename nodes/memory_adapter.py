"""The one memory adapter: how our models are registered with a memory manager, for our own nodes and for the
MODEL that KSampler drives alike.

Inside ComfyUI every component (DiT, text encoder, VAE) is a ModelPatcher of ours (nodes/comfy_patcher.py, as
ComfyUI-GGUF's GGUFModelPatcher is one) registered with ComfyUI's model management: it counts their VRAM, evicts other
models for them, moves them off when others need the room (a streamable stack partly: its other layers stream from
pinned RAM) and `POST /free` unloads them. The DiT's patcher wraps `Qwen21ComfyModel` (nodes/comfy_model.py), which is
also the MODEL output: the weights KSampler runs are the ones our sampler runs, with ComfyUI's LoRA patches merged
through our merge. Outside ComfyUI the local manager (qwen21_core/memory/manager.py) places them on the same terms,
within `--vram-budget`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..qwen21_core.memory.manager import (  # noqa: F401 - the nodes' one door to the memory rules
    TEXT_ENCODER_OFFLOAD,
    LocalMemoryManager,
    component_devices,
    evictable,
    expected_kv_placement,
    offload_after_encode,
    own_gpu,
    text_encoder_load_device,
    text_encoder_offload,
)
from ..qwen21_core.memory.planner import indexed_device
from ..qwen21_core.memory.sizing import job_bytes  # noqa: F401 - for the MODEL's memory_required
from ..qwen21_core.memory.streaming import StreamableStack
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
    device = indexed_device(device)
    if device.type != "cuda":
        return 2**62
    if host.IN_COMFYUI:
        return int(host.comfy_mm.get_total_memory(device))
    total = torch.cuda.get_device_properties(device).total_memory
    total = int(total * torch.cuda.get_per_process_memory_fraction(device))
    return total if LOCAL.budget is None else min(total, LOCAL.budget)


def _new_patcher(make_model, managed, load_device, offload_device):
    from .comfy_patcher import new_patcher  # imports ComfyUI: inside it only

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
    """

    def __init__(
        self,
        modules: dict[str, torch.nn.Module],
        load_device: torch.device,
        on_unload: Callable[[], None] | None = None,
        streamable: StreamableStack | None = None,
        comfy_model: Callable[[], torch.nn.Module] | None = None,
    ):
        self.modules = modules
        self.load_device = torch.device(load_device)
        self.streamable = streamable
        self.on_unload = on_unload
        self.full_bytes = sum(p.numel() * p.element_size() for m in modules.values() for p in m.parameters())
        self.name = "+".join(modules)  # for logs: "transformer", "text_encoder", "vae"
        self.evictable = True
        self.patcher = None
        if host.IN_COMFYUI:
            make = comfy_model or (lambda: Qwen21Weights(modules, host.offload_device()))
            self.patcher = _new_patcher(make, self, load_device, host.offload_device())

    def with_loras(self, stack: tuple) -> ManagedModules:
        """The same modules for a handle whose DiT runs with the LoRA `stack`: inside ComfyUI a clone of the patcher
        carrying it (ComfyUI sees other weights, and merging them is part of loading), outside the same object."""
        if self.patcher is None:
            return self
        clone = object.__new__(ManagedModules)
        clone.__dict__.update(self.__dict__)
        clone.patcher = self.patcher.clone_with_loras(stack)
        return clone

    def load(self, memory_required: int = 0) -> None:
        """Put the modules on their device (partly, for a streamable stack that does not fit), evicting other
        models if needed."""
        if self.patcher is not None:
            host.comfy_mm.load_models_gpu([self.patcher], memory_required=int(memory_required),
                                          force_full_load=self.streamable is None)  # fmt: skip
        else:
            LOCAL.load(self, int(memory_required))

    def unload(self) -> None:
        """Move the modules off their device now (as ComfyUI does when it needs the room)."""
        if self.patcher is not None:
            for index, loaded in enumerate(host.comfy_mm.current_loaded_models):
                if loaded.model.is_clone(self.patcher):
                    host.comfy_mm.current_loaded_models.pop(index).model_unload()
                    host.comfy_mm.soft_empty_cache()
                    return
        else:
            LOCAL.offload(self)

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
        if self.streamable is None or weight_budget >= self.full_bytes:
            return None
        s = self.streamable
        fixed = self.full_bytes - s.num_layers * s.layer_bytes + 2 * s.layer_bytes  # non-layer weights, 2 slots
        return max(0, min(s.num_layers, (weight_budget - fixed) // s.layer_bytes))
