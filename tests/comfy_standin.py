"""A stand-in for the newest ComfyUI's model patching (comfy.model_patcher, comfy.patcher_extension), written to the
signatures and call order of Comfy-Org/ComfyUI comfy/model_patcher.py at 08d0e510 (2026, dynamic VRAM era) and its
LoadedModel in comfy/model_management.py at 02b2b388, so that the door's patcher can be driven the newer way where
only ComfyUI 0.3.64 runs (tests/test_comfy_door_contract.py). Only what the door touches is here; the logic of each
method is the newest ComfyUI's in outline (what it calls, with which arguments, and which books it keeps), not its
weight handling, which our patcher replaces.

`install()` puts the modules into sys.modules under the names `comfy`, `comfy.model_patcher`, and
`comfy.patcher_extension`; the test removes them again.
"""

from __future__ import annotations

import sys
import types
import uuid

NEWEST_COMMIT = "08d0e510f4e539a1db39072589817136ac6cfa7d"


class CallbacksMP:
    ON_CLONE = "on_clone"
    ON_LOAD = "on_load_after"
    ON_DETACH = "on_detach_after"


class WrappersMP:
    OUTER_SAMPLE = "outer_sample"
    DIFFUSION_MODEL = "diffusion_model"


class ModelPatcher:
    """The newest ModelPatcher's lifecycle, in outline."""

    def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False, fast_disk=False):
        self.model = model
        self.load_device, self.offload_device = load_device, offload_device
        self.size, self.weight_inplace_update, self.fast_disk = size, weight_inplace_update, fast_disk
        self.patches, self.object_patches, self.object_patches_backup = {}, {}, {}
        self.patches_uuid = uuid.uuid4()
        self.callbacks, self.wrappers = {}, {}
        self.hook_patches, self.forced_hooks = {}, None
        self.is_injected, self.skip_injection = False, False
        self.calls: list[tuple] = []  # what the lifecycle called on the subclass, for the test
        for name, value in (("model_loaded_weight_memory", 0), ("lowvram_patch_counter", 0), ("model_lowvram", False),
                            ("current_weight_patches_uuid", None), ("model_offload_buffer_memory", 0)):  # fmt: skip
            if not hasattr(model, name):
                setattr(model, name, value)

    def is_dynamic(self):
        return False

    def model_size(self):
        return self.size

    def loaded_size(self):
        return self.model.model_loaded_weight_memory

    def current_loaded_device(self):
        return self.model.device

    def clone(self, disable_dynamic=False, model_override=None, force_deepcopy=False):
        model = self.model if model_override is None else model_override
        n = self.__class__(model, self.load_device, self.offload_device, self.model_size(),
                           weight_inplace_update=self.weight_inplace_update, fast_disk=self.fast_disk)  # fmt: skip
        n.patches = {k: list(v) for k, v in self.patches.items()}
        n.patches_uuid = self.patches_uuid
        n.object_patches = dict(self.object_patches)
        n.object_patches_backup = self.object_patches_backup  # shared, as ComfyUI shares it between clones
        n.callbacks = {k: list(v) for k, v in self.callbacks.items()}
        n.wrappers = dict(self.wrappers)
        return n

    def is_clone(self, other):
        return getattr(other, "model", None) is self.model

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        added = []
        names = self.model.state_dict()
        for key, patch in patches.items():
            name = key if isinstance(key, str) else key[0]
            if name in names:
                added.append(key)
                self.patches.setdefault(name, []).append((strength_patch, patch, strength_model, None, None))
        self.patches_uuid = uuid.uuid4()
        return added

    def add_object_patch(self, name, obj):
        self.object_patches[name] = obj

    def add_callback(self, call_type, callback):
        self.callbacks.setdefault(call_type, []).append(callback)

    def get_all_callbacks(self, call_type):
        return list(self.callbacks.get(call_type, []))

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def use_ejected(self, skip_and_inject_on_exit_only=False):
        return _Ejected()

    def unpatch_hooks(self, whitelist_keys_set=None):
        pass

    def apply_hooks(self, hooks, transformer_options=None, force_apply=False):
        return {}

    def eject_model(self):
        pass

    def inject_model(self):
        pass

    def model_patches_to(self, device):
        pass

    # the lifecycle: ComfyUI's manager comes in through partially_load, partially_unload and detach
    def patch_model(self, device_to=None, lowvram_model_memory=0, load_weights=True, force_patch_weights=False):
        for name, value in self.object_patches.items():
            old = getattr(self.model, name)
            self.object_patches_backup.setdefault(name, old)
            setattr(self.model, name, value)
        if load_weights:
            self.load(device_to, lowvram_model_memory=lowvram_model_memory, force_patch_weights=force_patch_weights,
                      full_load=lowvram_model_memory == 0)  # fmt: skip
        return self.model

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        self.calls.append(("base.unpatch_model", device_to, unpatch_weights))
        if unpatch_weights:
            self.model.model_lowvram = False
            self.model.lowvram_patch_counter = 0
            self.model.current_weight_patches_uuid = None
            if device_to is not None:
                self.model.device = device_to
            self.model.model_loaded_weight_memory = 0
            self.model.model_offload_buffer_memory = 0
        for name, value in self.object_patches_backup.items():
            setattr(self.model, name, value)
        self.object_patches_backup.clear()

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False):
        raise AssertionError("the door's patcher must replace partially_unload")

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        raise AssertionError("the door's patcher must replace load")

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        unpatch_weights = self.model.current_weight_patches_uuid is not None and (
            self.model.current_weight_patches_uuid != self.patches_uuid or force_patch_weights)  # fmt: skip
        used = self.model.model_loaded_weight_memory
        self.unpatch_model(self.offload_device, unpatch_weights=unpatch_weights)
        if unpatch_weights:
            extra_memory += used - self.model.model_loaded_weight_memory
        self.patch_model(load_weights=False)
        if extra_memory < 0 and not unpatch_weights:
            self.partially_unload(self.offload_device, -extra_memory, force_patch_weights=force_patch_weights)
            return 0
        if not self.model.model_lowvram and self.model.model_loaded_weight_memory > 0:
            return 0
        full_load = self.model.model_loaded_weight_memory + extra_memory > self.model_size()
        current = self.model.model_loaded_weight_memory
        try:
            self.load(device_to, lowvram_model_memory=current + extra_memory, force_patch_weights=force_patch_weights,
                      full_load=full_load)  # fmt: skip
        except Exception:
            self.detach()
            raise
        return self.model.model_loaded_weight_memory - current

    def detach(self, unpatch_all=True):
        self.eject_model()
        self.model_patches_to(self.offload_device)
        if unpatch_all:
            self.unpatch_model(self.offload_device, unpatch_weights=unpatch_all)
        for callback in self.get_all_callbacks(CallbacksMP.ON_DETACH):
            callback(self, unpatch_all)
        return self.model


class _Ejected:
    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


class LoadedModel:
    """comfy.model_management.LoadedModel at 02b2b388: how the manager calls a patcher."""

    def __init__(self, model):
        self.model = model
        self.device = model.load_device

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        self.model.model_patches_to(self.device)
        return self.model.partially_load(self.device, lowvram_model_memory or 1e32,
                                         force_patch_weights=force_patch_weights)  # fmt: skip

    def model_unload(self, memory_to_free=None, unpatch_weights=True):
        if memory_to_free is not None and memory_to_free < self.model.loaded_size():
            freed = self.model.partially_unload(self.model.offload_device, memory_to_free)
            if freed >= memory_to_free:
                return False
        self.model.detach(unpatch_weights)
        return True


def install() -> dict[str, types.ModuleType]:
    """The stand-in modules, in sys.modules; returns them by name (for the test to remove)."""
    comfy = types.ModuleType("comfy")
    model_patcher = types.ModuleType("comfy.model_patcher")
    model_patcher.ModelPatcher = ModelPatcher
    extension = types.ModuleType("comfy.patcher_extension")
    extension.CallbacksMP, extension.WrappersMP = CallbacksMP, WrappersMP
    comfy.model_patcher, comfy.patcher_extension = model_patcher, extension
    modules = {"comfy": comfy, "comfy.model_patcher": model_patcher, "comfy.patcher_extension": extension}
    sys.modules.update(modules)
    return modules
