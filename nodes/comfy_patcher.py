"""Our ModelPatcher: how ComfyUI's model management loads, partly loads and unloads our components, and how ComfyUI's
LoRA patches reach our weights. Imported only inside ComfyUI (nodes/memory_adapter.py).

- Loads honour ComfyUI's budget with our streaming: a partial load keeps some DiT blocks (text-encoder layers)
  resident and streams the rest from pinned RAM (our modules are plain torch layers, not comfy.ops casting layers,
  so the stock partial load would leave them half on the CPU).
- Weight patches: ComfyUI's LoRA loaders add patches per weight name of the MODEL's state dict (Qwen21ComfyModel's
  view of LoRA-addressable layers). Loading merges them, with the LoRAs our own LoRA node put on the handle, through
  our merge (qwen21_core/lora/merge.py): requantised into fp8 / int8 / int8_convrot, exact on removal, incremental
  between stacks. The merged weights stay until another stack is asked for, so switching between clones (a LoRA'd
  MODEL and the plain one) moves no weights off the device.
- The DiT's patcher wraps ComfyUI's sampling (OUTER_SAMPLE): before loading, a pending negative prompt is encoded when
  the guidance will use it; after the run, the run's branches are released and its stats logged.
"""

from __future__ import annotations

import logging
import math
import uuid
from pathlib import Path

import comfy.model_patcher
import comfy.patcher_extension

from ..qwen21_core.lora.reading import LoraError, LoraFile, LoraLayer
from .comfy_conditioning import resolve_pending

log = logging.getLogger(__name__)

SAMPLING_WRAPPER_KEY = "qwen21"


class Qwen21Patcher(comfy.model_patcher.ModelPatcher):
    qwen21_loras: tuple = ()  # (LoraFile, strength) pairs of our own LoRA node, merged before ComfyUI's patches
    _converted: tuple = (None, ())  # (patches_uuid, ComfyUI's patches as our stack): converted once per patch set

    @property
    def managed(self):
        return self.model.qwen21_managed

    def clone(self):
        clone = super().clone()
        clone.qwen21_loras = self.qwen21_loras
        return clone

    def clone_with_loras(self, stack: tuple) -> Qwen21Patcher:
        clone = self.clone()
        clone.qwen21_loras = tuple(stack)
        clone.patches_uuid = uuid.uuid4()  # other weights: ComfyUI must not take it for the same model
        return clone

    def model_size(self):
        return self.model.qwen21_managed.full_bytes

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        """ComfyUI's LoRA loaders add what their key map matched. Nothing at all means the file names no layer of our
        DiT (a LoRA for another model): an error here, at the loader, instead of a LoRA that silently does nothing."""
        if not patches and hasattr(self.model, "apply_lora_stack"):
            raise LoraError("Qwen21 MODEL: this LoRA matches no layer of Qwen-Image-2.1's diffusion model (ComfyUI "
                            "logged each key it could not load as 'lora key not loaded'): is it made for another "
                            "model? Qwen21 Load LoRA reads every known key layout and names the model it was made "
                            "for")  # fmt: skip
        return super().add_patches(patches, strength_patch, strength_model)

    # ---- loading --------------------------------------------------------------------------------------------

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        device_to = device_to or self.load_device
        managed = self.managed
        whole = full_load or lowvram_model_memory == 0 or lowvram_model_memory >= self.model_size()
        resident = None if whole or managed.streamable is None else managed.resident_for(int(lowvram_model_memory))
        managed.place(device_to, resident)
        self._merge_weight_patches()
        model = self.model
        model.model_lowvram = resident is not None
        model.lowvram_patch_counter = 0
        model.device = device_to
        model.model_loaded_weight_memory = managed.device_bytes()
        model.current_weight_patches_uuid = self.patches_uuid
        if managed.streamable is not None:
            layers = "whole" if resident is None else f"{resident}/{managed.streamable.num_layers} layers resident"
            log.info("qwen21: %s on %s (%s)", type(managed.streamable).__name__, device_to, layers)
        for callback in self.get_all_callbacks(comfy.patcher_extension.CallbacksMP.ON_LOAD):
            callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        with self.use_ejected(skip_and_inject_on_exit_only=True):
            loaded = self.model.model_loaded_weight_memory
            self.patch_model(load_weights=False)  # object patches and injections, as ComfyUI's does
            if not self.model.model_lowvram and loaded > 0:
                self._merge_weight_patches()  # whole already: only the LoRA stack may differ (a clone's)
                self.model.current_weight_patches_uuid = self.patches_uuid
                return 0
            budget = loaded + extra_memory
            self.load(device_to, lowvram_model_memory=budget, full_load=budget >= self.model_size())
            return self.model.model_loaded_weight_memory - loaded

    def partially_unload(self, device_to, memory_to_free=0):
        managed = self.managed
        before = managed.device_bytes()
        if managed.streamable is None:  # loads whole: leaving means leaving entirely
            managed.place(device_to)
        else:
            managed.place(self.load_device, managed.resident_for(max(0, before - int(memory_to_free))))
        self.model.model_lowvram = managed.device_bytes() > 0
        self.model.model_loaded_weight_memory = managed.device_bytes()
        return before - managed.device_bytes()

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights and device_to is not None:
            self.managed.place(device_to)  # streaming off, everything whole where it goes
            self.model.device = device_to
            self.model.model_loaded_weight_memory = 0
            self.model.model_lowvram = False
            self.model.current_weight_patches_uuid = None
        # the merged LoRA stays in the weights (the next load brings them to its own stack); object patches undone
        super().unpatch_model(device_to, unpatch_weights=False)

    # ---- weight patches -------------------------------------------------------------------------------------

    def _merge_weight_patches(self) -> None:
        if self.hook_patches:
            raise ValueError("qwen21: LoRA hooks on conditionings (Create Hook LoRA, Set CLIP/Model hooks) cannot "
                             "apply to our models; put the LoRA on the MODEL with a LoRA loader instead")  # fmt: skip
        apply = getattr(self.model, "apply_lora_stack", None)
        if apply is None:
            if self.patches:
                raise ValueError(f"qwen21: the {self.managed.name} takes no weight patches (LoRAs apply to the "
                                 "diffusion model only)")  # fmt: skip
            return
        if self._converted[0] != self.patches_uuid:  # every load asks; a LoRA'd MODEL converts its patches once
            self._converted = (self.patches_uuid, tuple(comfy_patches_as_stack(
                self.patches, self.model.lora_slots(), self.patches_uuid)))  # fmt: skip
        apply((*self.qwen21_loras, *self._converted[1]))


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

    def on_detach(_patcher, unpatch_all=True):
        if unpatch_all:
            on_unload()

    return on_detach


def sampling_wrapper(executor, noise, latent_image, sampler, sigmas, *args, **kwargs):
    """Around ComfyUI's whole sampling run (before the model loads, after it ends, whatever ends it)."""
    guider = executor.class_obj
    diffusion = guider.model_patcher.model.diffusion_model
    cfg = getattr(guider, "cfg", None)
    unguided = cfg is not None and math.isclose(cfg, 1.0) and not guider.model_options.get(
        "disable_cfg1_optimization", False)  # fmt: skip
    for name, entries in guider.conds.items():
        if name != "positive" and not unguided:  # ComfyUI skips the negative at cfg 1: so do we
            for entry in entries:
                resolve_pending(entry)
    diffusion.run_settings = {"cfg": 1.0 if cfg is None else float(cfg), "rows": int(noise.shape[0])}
    try:
        return executor(noise, latent_image, sampler, sigmas, *args, **kwargs)
    finally:
        stats = diffusion.close_run()
        if stats:
            log.info("qwen21: %d model calls, %d prefix computations, %d replayed steps, prefix cache %s, decode "
                     "graphs %s, peak %.2f GiB", stats.get("steps", 0), stats.get("prefills", 0),
                     stats.get("replayed_steps", 0), stats.get("prefix_cache"), stats.get("decode_graph"),
                     stats.get("peak_vram_mib", 0) / 1024)  # fmt: skip


# ---- ComfyUI's patches as our LoRA stack --------------------------------------------------------------------


def comfy_patches_as_stack(patches: dict, layers: dict, patches_uuid) -> list[tuple[LoraFile, float]]:
    """ComfyUI's weight patches (`ModelPatcher.patches`: weight name -> [(strength, patch, strength_model, offset,
    function)]) as (LoraFile, strength) pairs for our merge, one per strength; `layers`: our LoRA-addressable layers
    (lora/merge.py lora_layers). Patches our merge cannot apply (LoHa, LoKr, DoRA, model merges, functions) are
    refused by name."""
    if not patches:
        return []
    groups: dict[float, list[LoraLayer]] = {}
    for key, entries in patches.items():
        name = key.removeprefix("diffusion_model.").removesuffix(".weight")
        if name not in layers:
            raise LoraError(f"a ComfyUI patch names {key!r}, which is no layer of Qwen-Image-2.1's DiT")
        for strength, patch, strength_model, offset, function in entries:
            if strength_model != 1.0 or function is not None:
                raise LoraError(f"a ComfyUI patch on {key} scales the model's own weight or applies a function "
                                "(a model merge?): our merged weights take LoRAs and differences only")  # fmt: skip
            target = _target(name, offset, layers)
            groups.setdefault(float(strength), []).append(_lora_layer(target, key, patch))
    return [(LoraFile(Path("ComfyUI LoRA patches"), tuple(group), "ComfyUI patches",
                      identity=f"comfyui-patches:{patches_uuid}:{strength}"), strength)
            for strength, group in groups.items()]  # fmt: skip


def _target(name: str, offset, layers) -> str:
    """The layer a patch lands on: `name`, or for a patch on rows of a fused weight the layer those rows are."""
    if offset is None:
        return name
    dim, start, size = offset
    slot = layers[name]
    want = slice(slot.rows.start + start, slot.rows.start + start + size)
    if dim == 0:
        for other, candidate in layers.items():
            if candidate.param == slot.param and candidate.rows == want:
                return other
    raise LoraError(f"a ComfyUI patch on {name} covers {offset} (dim, start, size), which is no layer of ours")


def _lora_layer(target: str, key: str, patch) -> LoraLayer:
    kind, weights = _kind_and_weights(patch)
    if kind == "diff":
        return LoraLayer(target, None, None, weights[0], 1.0)
    if kind != "lora":
        raise LoraError(f"a ComfyUI patch on {key} is a {kind!r} adapter: our merge takes LoRA (B @ A) and full "
                        "differences only (LoHa, LoKr, GLoRA, OFT and DoRA are not supported)")  # fmt: skip
    up, down, alpha, mid, dora_scale, *reshape = weights
    if mid is not None or dora_scale is not None or any(r is not None for r in reshape):
        raise LoraError(f"the LoRA patch on {key} has a mid weight, a DoRA scale or a reshape: not supported")
    rank = down.shape[0]
    if rank == 0:
        raise LoraError(f"the LoRA patch on {key} has rank 0")
    scale = 1.0 if alpha is None else float(alpha) / rank
    if not math.isfinite(scale):
        raise LoraError(f"the LoRA patch on {key} has alpha {alpha}")
    return LoraLayer(target, up.flatten(1), down.flatten(1), None, scale)


def _kind_and_weights(patch) -> tuple[str, tuple]:
    """(kind, weights) of a patch in either form ComfyUI uses: an adapter object (`.name`, `.weights`) or a
    (kind, weights) tuple."""
    if hasattr(patch, "weights") and hasattr(patch, "name"):
        return patch.name, tuple(patch.weights)
    if isinstance(patch, tuple) and len(patch) == 2 and isinstance(patch[0], str):
        return patch[0], tuple(patch[1])
    return type(patch).__name__, ()
