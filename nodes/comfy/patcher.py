"""Our ModelPatcher: how ComfyUI's model management loads, partly loads and unloads our components, and how ComfyUI's
LoRA patches reach our weights. Imported only inside ComfyUI (nodes/memory_adapter.py).

It wraps ComfyUI's lifecycle rather than replacing it, so that it works on 0.3.64 and on the newest ComfyUI (whose
methods take more keywords, and which has dynamic VRAM): every override takes `*args, **kwargs` and hands them on.
- ComfyUI's `partially_load` (what its manager calls to load a model) runs as it is: it undoes another clone's
  object patches, applies this clone's (ModelSamplingSD3 and the like), then calls our `load` with the memory it
  grants. Only its unpatching of another clone's *weights* is skipped: our merge brings the weights to this clone's
  LoRA stack exactly and incrementally (qwen21_core/lora/merge.py), so switching between a LoRA'd MODEL and the plain
  one moves no weights off the device.
- `load` and `partially_unload` are ours: ComfyUI's cast comfy.ops layers module by module, while ours are plain
  torch layers whose stack streams (memory/streaming.py): a partial load keeps some DiT blocks (text-encoder layers)
  resident and streams the rest from pinned RAM. They keep ComfyUI's books (`model_loaded_weight_memory`,
  `model_lowvram`, `device`, `current_weight_patches_uuid`, the ON_LOAD callbacks, forced hooks).
- `unpatch_model` moves our stacks itself (ComfyUI's `.to()` must not see a streaming stack) and lets ComfyUI's
  version do the rest (hooks, backups, object patches).
- Not dynamic: ComfyUI's dynamic VRAM manages comfy.ops layers; ours manage their own residency.
- The DiT's patcher wraps ComfyUI's sampling (OUTER_SAMPLE, nodes/comfy/sampling.py).
"""

from __future__ import annotations

import logging
import uuid

import comfy.model_patcher
import comfy.patcher_extension

from ...qwen21_core.lora.comfy_patches import MODEL_PREFIX, comfy_patches_as_stack
from ...qwen21_core.lora.reading import LoraError
from .sampling import SAMPLING_WRAPPER_KEY, sampling_wrapper

log = logging.getLogger(__name__)


class Qwen21Patcher(comfy.model_patcher.ModelPatcher):
    qwen21_loras: tuple = ()  # (LoraFile, strength) pairs of our own LoRA node, merged before ComfyUI's patches

    @property
    def managed(self):
        return self.model.qwen21_managed

    def is_dynamic(self):
        return False

    def clone(self, *args, **kwargs):
        clone = super().clone(*args, **kwargs)
        clone.qwen21_loras = self.qwen21_loras
        return clone

    def clone_with_loras(self, stack: tuple) -> Qwen21Patcher:
        clone = self.clone()
        clone.qwen21_loras = tuple(stack)
        clone.patches_uuid = uuid.uuid4()  # other weights: ComfyUI must not take it for the same model
        return clone

    def model_size(self):
        return self.managed.full_bytes

    def add_patches(self, patches, *args, **kwargs):
        """ComfyUI's LoRA loaders add what their key map matched; the base keeps those that name a weight of the
        MODEL's state dict. A file that names no layer of our DiT (a LoRA for another model), one that changes
        biases (which our merge does not touch), and factors our merge would refuse (qwen21_core/lora/
        comfy_patches.py) are refused here, at the loader, instead of silently doing nothing or failing at the
        sampler."""
        added = super().add_patches(patches, *args, **kwargs)
        if not hasattr(self.model, "apply_lora_stack"):
            return added
        names = [key if isinstance(key, str) else key[0] for key in patches]
        biases = sorted(name for name in names if name.startswith(MODEL_PREFIX) and name.endswith(".bias"))
        if biases:
            raise LoraError(f"Qwen21 MODEL: this LoRA changes {len(biases)} biases ({', '.join(biases[:3])}...); our "
                            "merge applies LoRAs to the linear layers' weights only")  # fmt: skip
        if not added:
            raise LoraError("Qwen21 MODEL: this LoRA matches no layer of Qwen-Image-2.1's diffusion model (ComfyUI "
                            "logged each key it could not load as 'lora key not loaded'): is it made for another "
                            "model? Qwen21 Load LoRA reads every known key layout and names the model it was made "
                            "for")  # fmt: skip
        comfy_patches_as_stack(self.patches, self.model.lora_slots(), self.patches_uuid)  # raises what it refuses
        return added

    # ---- loading --------------------------------------------------------------------------------------------

    def partially_load(self, device_to, extra_memory=0, *args, **kwargs):
        """ComfyUI's partial load (its manager's way in), with the weights counted as this clone's whatever LoRA
        stack another clone left merged: `load` (or, when the model is whole already, the merge below) brings them
        to this clone's stack."""
        if self.model.current_weight_patches_uuid is not None:
            self.model.current_weight_patches_uuid = self.patches_uuid
        kwargs.pop("force_patch_weights", None)  # our merge is exact: nothing to re-patch from scratch
        loaded = super().partially_load(device_to, extra_memory, *args, **kwargs)
        if self.managed.device_bytes() > 0:
            self._merge_weight_patches()
        return loaded

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, *args,
             **kwargs):  # fmt: skip
        device_to = device_to or self.load_device
        managed = self.managed
        with self.use_ejected():
            self.unpatch_hooks()
            whole = full_load or lowvram_model_memory == 0 or lowvram_model_memory >= self.model_size()
            resident = None if whole else managed.resident_for(int(lowvram_model_memory))
            managed.place(device_to, resident)
            self._merge_weight_patches()
            model = self.model
            model.model_lowvram = resident is not None
            model.device = device_to
            model.model_loaded_weight_memory = managed.device_bytes()
            model.current_weight_patches_uuid = self.patches_uuid
        if managed.streamable is not None:
            layers = "whole" if resident is None else f"{resident}/{managed.streamable.num_layers} layers resident"
            log.info("qwen21: %s on %s (%s)", type(managed.streamable).__name__, device_to, layers)
        for callback in self.get_all_callbacks(comfy.patcher_extension.CallbacksMP.ON_LOAD):
            callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)
        self.apply_hooks(self.forced_hooks, force_apply=True)

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
        managed = self.managed
        before = managed.device_bytes()
        if managed.streamable is None:  # loads whole: leaving means leaving entirely
            managed.place(device_to)
        else:
            managed.place(self.load_device, managed.resident_for(max(0, before - int(memory_to_free))))
        after = managed.device_bytes()
        self.model.model_lowvram = after > 0
        self.model.model_loaded_weight_memory = after
        return before - after

    def unpatch_model(self, device_to=None, unpatch_weights=True, *args, **kwargs):
        if unpatch_weights:
            if device_to is not None:
                self.managed.place(device_to)  # streaming off, everything whole where it goes
                self.model.device = device_to
            self.model.model_lowvram = False  # none of ComfyUI's low-VRAM casting was set up on our layers
        # the merged LoRA stack stays in the weights (the next load brings them to its clone's stack)
        super().unpatch_model(None, unpatch_weights, *args, **kwargs)

    # ---- weight patches -------------------------------------------------------------------------------------

    def _merge_weight_patches(self) -> None:
        if self.hook_patches:
            raise ValueError("qwen21: LoRA hooks on conditionings (Create Hook LoRA, Set CLIP/Model hooks) cannot "
                             "apply to our models; put the LoRA on the MODEL with a LoRA loader instead")  # fmt: skip
        apply = getattr(self.model, "apply_lora_stack", None)
        if apply is not None:
            apply(self.qwen21_loras, self.patches, self.patches_uuid)
        elif self.patches:
            raise ValueError(f"qwen21: the {self.managed.name} takes no weight patches (LoRAs apply to the "
                             "diffusion model only)")  # fmt: skip


def new_patcher(model, managed, load_device, offload_device) -> Qwen21Patcher:
    model.qwen21_managed = managed
    patcher = Qwen21Patcher(model, load_device=load_device, offload_device=offload_device)
    if managed.on_unload is not None:
        patcher.add_callback(comfy.patcher_extension.CallbacksMP.ON_DETACH, _on_real_unload(managed.on_unload))
    if hasattr(model, "diffusion_model"):
        patcher.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, SAMPLING_WRAPPER_KEY,
                                     sampling_wrapper)  # fmt: skip
    return patcher


def _on_real_unload(on_unload):
    """An ON_DETACH callback that calls `on_unload` only when the weights really leave: ComfyUI also detaches a
    loaded model each time it loads it again (load_models_gpu treats a model as a clone of itself), with
    unpatch_all False and the weights left in place; freeing our decode graphs then would throw them away at every
    run."""

    def on_detach(_patcher, unpatch_all=True, *args, **kwargs):
        if unpatch_all:
            on_unload()

    return on_detach
