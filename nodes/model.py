"""What a QWEN21_MODEL link carries: the loaded pipeline plus its registration with ComfyUI's memory
manager, and the small bits of glue every node needs (placing weights before use, status lines).

ComfyUI keeps a loader's output alive while the loader's inputs are unchanged, so this handle is
where long-lived state hangs: the weights, and through the pipeline its prefix caches and decode
graphs. When ComfyUI unloads the transformer (POST /free, an OOM, another model needing the room)
those caches are released with it.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import weakref

import torch

from ..qwen21_core.memory.out_of_memory import retry_out_of_memory
from . import host, memory_adapter
from .memory_adapter import ManagedModules
from .preview import fit_latent_rgb

log = logging.getLogger(__name__)

# Link types between our nodes; the prefix keeps them apart from every other pack's types.
MODEL_TYPE = "QWEN21_MODEL"
CONDITIONING_TYPE = "QWEN21_CONDITIONING"


class Qwen21Model:
    """offload_text_encoder: "auto", "always" or "never" (or an older workflow's boolean): when the text encoder
    leaves the GPU, decided by the memory manager (qwen21_core/memory/manager.py)."""

    def __init__(self, pipe, offload_text_encoder="auto", device: torch.device | None = None):
        self.pipe = pipe
        self.offload_text_encoder = memory_adapter.text_encoder_offload(offload_text_encoder)
        # where everything runs (the pipeline's, unless given); ComfyUI may park modules elsewhere between runs
        self.device = device = torch.device(device) if device is not None else pipe.device
        # its unloading frees what reads its weights by address (decode graphs), not the references or host buffers
        unloaded = pipe.release_device_caches
        self._preview_projection = [None]  # shared by the LoRA handles made from this one
        # the DiT's patcher wraps the ComfyUI MODEL (nodes/comfy/model.py): KSampler's and our sampler's weights
        self.transformer = ManagedModules({"transformer": pipe.transformer}, device, on_unload=unloaded,
                                          streamable=pipe.transformer, comfy_model=self._comfy_model,
                                          merge_loras=self._merge_loras)  # fmt: skip
        # the text encoder and the VAE run where the loader put them (another GPU than the DiT's, perhaps)
        self.text_encoder = ManagedModules({"text_encoder": pipe.text_encoder.model}, pipe.text_encoder_device,
                                           streamable=pipe.text_encoder)  # fmt: skip
        self.vae = ManagedModules({"vae": pipe.vae}, pipe.vae_execution_device)
        self.text_encoder.evictable = memory_adapter.evictable(self.offload_text_encoder)
        self.text_encoder.runs_in_place = True
        self.control = None  # (qwen21_core.control.Control, its weights' ManagedModules): with_control
        # a memory manager places the weights (ComfyUI's, or the local one) and owns the one budget
        pipe.memory = memory_adapter.pipeline_memory()
        # Everything built on the model (pipeline, decode graphs, their prefix caches) holds the transformer,
        # so its end says they are all gone: after POST /free, or when a changed loader input replaces it.
        where = pipe.sources.get("transformer", {}).get("path", "?")
        weakref.finalize(pipe.transformer, log.info, "Qwen21 model freed (%s)", os.path.basename(where)).atexit = False

    @property
    def loras(self) -> tuple:
        """(LoraFile, strength) pairs this handle's DiT runs with (merged when the DiT is placed for a run)."""
        return self.transformer.loras

    def __repr__(self) -> str:
        loras = f", LoRAs {[(lora.path.name, s) for lora, s in self.loras]}" if self.loras else ""
        return f"Qwen21Model({self.pipe.sources}, {self.pipe.dtype}, {self.pipe.device}{loras})"

    def with_lora(self, lora, strength: float) -> Qwen21Model:
        """A new handle on the same pipeline whose DiT runs with `lora` added to this handle's LoRAs.

        This handle is left as it is: ComfyUI caches node outputs, so both may be used in one graph. The weights
        are brought to a handle's LoRAs right before its DiT runs (`sample`).
        """
        handle = copy.copy(self)
        handle.transformer = self.transformer.with_loras((*self.loras, (lora, float(strength))))
        return handle

    def with_control(self, control, weights: ManagedModules) -> Qwen21Model:
        """A new handle on the same pipeline whose runs go through the Fun-Control `control` (qwen21_core/control.py);
        `weights`: the branch's registration with the memory manager, loaded beside the DiT. This handle is left as it
        is."""
        handle = copy.copy(self)
        handle.control = (control, weights)
        return handle

    def _merge_loras(self, stack: tuple) -> None:
        self.pipe.set_loras(stack)

    def _comfy_model(self):
        from .comfy.model import Qwen21ComfyModel  # inside ComfyUI only

        return Qwen21ComfyModel(self.pipe, self.preview_projection, load_vae=lambda: self.vae.load())

    @property
    def comfy_model(self):
        """The ComfyUI MODEL (a ModelPatcher) that KSampler drives, with this handle's control; None outside ComfyUI."""
        patcher = self.transformer.patcher
        if patcher is None or self.control is None:
            return patcher
        from .comfy.control import with_control  # inside ComfyUI only

        return with_control(patcher, *self.control)

    def comfy_vae(self):
        """Our VAE as a ComfyUI VAE (VAE Decode, VAE Encode take it); None outside ComfyUI."""
        if not host.IN_COMFYUI:
            return None
        from .comfy.vae import Qwen21ComfyVAE

        return Qwen21ComfyVAE(self)

    @contextlib.contextmanager
    def _text_encoder_loaded(self, activation_bytes: int):
        """The text encoder placed by the memory manager for the block, with `activation_bytes` left free beside
        it; unloaded after it only with offload_text_encoder "always" (else it stays until the room is needed)."""
        self.text_encoder.load(activation_bytes)  # on the pipeline's execution device; the DiT need not be there
        try:
            yield
        finally:
            if memory_adapter.offload_after_encode(self.offload_text_encoder, self.pipe.text_encoder_device,
                                                   self.device):  # fmt: skip
                self.text_encoder.unload()

    def encode(self, **kwargs):
        """pipe.encode with the text encoder (and the VAE, for condition images) placed first; an out-of-memory
        error is retried once as sampling's is (an earlier run's idle caches and graphs released first)."""

        images = len(kwargs.get("images") or ())
        text_encoder = self.pipe.text_encoder
        tokens = text_encoder.estimated_tokens(kwargs.get("prompt", ""), images, kwargs.get("output_resolution", 1024))
        needed = text_encoder.activation_bytes(tokens)

        def run():
            self.vae.load()
            with self._text_encoder_loaded(needed):
                return self.pipe.encode(**kwargs)

        return self._retry_out_of_memory(run, f"encoding the prompt with {images} condition images", needed)

    def encode_negative(self, cond) -> None:
        """Encode `cond`'s pending negative prompt (once), the text encoder placed for it: it comes back even if it
        was offloaded after the positive prompt."""
        if cond.negative_pending is not None:
            with self._text_encoder_loaded(self.pipe.text_encoder.activation_bytes(cond.negative_pending.length)):
                self.pipe.encode_negative(cond)

    def sample(self, cond, request, options=None):
        """pipe.sample_request (`request`: a SampleRequest) with the DiT placed first, room kept beside it for what the
        run needs, and this handle's LoRAs merged; an out-of-memory error is retried once (`_retry_out_of_memory`)."""
        request = request.sized(cond)
        if request.guided:
            self.encode_negative(cond)  # only now that guidance needs it, once per conditioning
        companions = ()
        if self.control is not None and request.control is None:
            control, weights = self.control
            request = request.replace(control=control)
            if request.controlled:
                companions = (weights,)
                self.vae.load()  # the control image is encoded before the DiT is placed, never displacing it
                self.pipe.control_context(control, request.latent_size)
        placement = self._kv_estimate(cond, request, options)
        needed = self.pipe.sampling_bytes(cond, request, options, kv_placement=placement)

        def run():
            # the previous run's idle caches come back to this one (adopted or evicted): not counted as taken, or
            # a rerun with a new seed would see them as used memory and stream part of the DiT. Loading also brings
            # the weights to this handle's LoRAs, and places a control branch beside them.
            self.transformer.load(max(0, needed - self.pipe.idle_cache_bytes()), companions)
            return self.pipe.sample_request(cond, request, options)

        what = (f"sampling {request.width}x{request.height} with {cond.num_images} condition images, batch "
                f"{request.batch_size}")  # fmt: skip
        return self._retry_out_of_memory(run, what, needed)

    def _retry_out_of_memory(self, run, what: str, needed: int):
        """run(); an out-of-memory error is retried once with less memory planned (qwen21_core/memory/
        out_of_memory.py: caches and graphs released first), then named with what to lower."""
        return retry_out_of_memory(run, what, lambda: self.pipe.release(),
                                   lambda: memory_adapter.smaller_plan(self.device, needed))  # fmt: skip

    def _kv_estimate(self, cond, request, options) -> str:
        """The K/V placement to ask the memory manager's room for (memory/manager.py expected_kv_placement)."""
        gpu = self.pipe.sampling_bytes(cond, request, options, kv_placement="gpu")
        return memory_adapter.expected_kv_placement(getattr(options, "kv_placement", "auto"),
                                                    self.transformer.full_bytes, gpu,
                                                    memory_adapter.device_capacity_bytes(self.device))  # fmt: skip

    def decode(self, latents: torch.Tensor, **kwargs):
        """pipe.decode with the VAE placed first and, for tiling "auto", room asked for an untiled pass as ComfyUI's
        own VAE Decode asks (memory_adapter.working_memory_request says when)."""
        needed = 0
        if kwargs.get("tiling", "auto") == "auto":  # the batch in one pass, else one image a pass
            passes = [self.pipe.vae.untiled_decode_bytes((images, *latents.shape[1:]), kwargs.get("precision"),
                                                         kwargs.get("quality", "exact"))
                      for images in (latents.shape[0], 1)]  # fmt: skip
            needed = memory_adapter.working_memory_request(passes, self.pipe.vae_execution_device, self.vae.full_bytes)
        self.vae.load(needed)
        return self.pipe.decode(latents, **kwargs)

    def encode_image(self, images: torch.Tensor, masks: torch.Tensor | None):
        self.vae.load()
        return self.pipe.encode_image(images, masks=masks)

    def preview_projection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent -> RGB factors and bias for live previews, fitted from this model's VAE on first use."""
        if self._preview_projection[0] is None:
            self._preview_projection[0] = fit_latent_rgb(lambda images: self.encode_image(images, None))
        return self._preview_projection[0]


def sample_status(stats: dict) -> str:
    """One compact line from the pipeline's sampling stats, for the node's status text."""
    if not stats:
        return ""
    cache = {"reused": "hit (prefill skipped)"}.get(stats.get("prefix_cache", "off"), stats.get("prefix_cache", "off"))
    if cache != "off":
        mib = stats.get("prefix_cache_mib", 0)
        cache += f", {mib:.1f} MiB" if mib < 10 else f", {mib:.0f} MiB"
    line = (
        f"{stats.get('steps_per_second', 0):.2f} steps/s · prefix cache {cache} · "
        f"graphs {stats.get('decode_graph', 'off')} · peak {stats.get('peak_vram_mib', 0) / 1024:.1f} GiB"
    )
    if stats.get("control", "off") != "off":
        line += f" · control {stats['control']}"
    parallel = stats.get("parallel", "off")
    return line if parallel == "off" else f"{line} · {parallel}"


def decode_status(stats: dict) -> str:
    """One compact line from the pipeline's VAE decode stats."""
    if not stats:
        return ""
    path = f"tiled ({stats.get('tiles')} tiles)" if stats.get("tiled") else "untiled"
    retries = stats.get("oom_retries", 0)
    line = f"VAE {path} · {stats.get('quality', 'exact')} · {stats.get('precision')}"
    if "seconds" in stats:
        line += f" · {stats['seconds']:.2f} s"
    if "peak_vram_mib" in stats:
        line += f" · peak {stats['peak_vram_mib'] / 1024:.1f} GiB"
    return line + (f" · {retries} OOM retries" if retries else "")
