"""Our DiT behind ComfyUI's own MODEL type, so KSampler, every ComfyUI sampler and scheduler, and custom sampling
nodes drive it. Imported only inside ComfyUI (nodes/memory_adapter.py builds the patcher,
nodes/comfy/patcher.py, around this model).

- `Qwen21ComfyModel` is a `comfy.model_base.BaseModel` with flow-matching model sampling (ComfyUI's
  ModelSamplingFlux + CONST, as native Qwen-Image-2.1 uses: timestep = sigma, the exponential time shift of the
  released schedule at 1024x1024, so KSampler's `simple` is the released schedule there without its terminal stretch).
  Its `extra_conds` turns each CONDITIONING into our Conditioning; its state dict is a view of LoRA-addressable layer
  names, so ComfyUI's LoRA loaders find our layers (memory_adapter's patcher merges their patches through ours).
- `Qwen21Diffusion` is the diffusion_model ComfyUI calls once per model evaluation: it splits the batch into the
  conditionings ComfyUI put together and asks the run's `SamplingRun` (nodes/comfy/sampling.py, carried in the run's
  transformer_options) for their velocity: the prefix K/V once per conditioning, decode steps replayed from CUDA
  graphs. It keeps no state of a run.
- `Qwen21Cond` is the model condition carrying our Conditioning; cond and uncond may batch into one call.
- `Qwen21LatentFormat` (nodes/comfy/latents.py): 64 channels at 1/16, normalised with the loaded VAE's mean and std;
  ComfyUI's own empty latents are sized for it there.

CONDITIONING layout (native ComfyUI's for Qwen-Image-2.1, so ours and native's are interchangeable):
`[[context [1, L, 4096] (hidden states without the image-pad rows), {"image_slots": [...], "reference_latents":
[raw [1, 64, h, w], ...], "qwen21": <our marker>}]]`. The tensors are the truth: ComfyUI's conditioning nodes change
them (ConditioningZeroOut zeroes the context, ConditioningAverage mixes two) and the model follows; our marker only
lets an unchanged conditioning from Qwen21 Encode skip the conversion (and keep its content hash).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import comfy.conds
import comfy.latent_formats
import comfy.model_base
import comfy.patcher_extension
import comfy.supported_models_base
import torch

from ...qwen21_core.errors import stable_name
from ...qwen21_core.lora.comfy_patches import comfy_patches_as_stack
from ...qwen21_core.lora.merge import lora_layers
from ...qwen21_core.options import SampleOptions
from ...qwen21_core.scheduler import resolution_shift
from .. import memory_adapter
from .conditioning import conditioning_from_entry, unencoded_negative
from .control import RUN_CONTROL_SIZING, control_option
from .latents import Qwen21LatentFormat, size_empty_latents
from .sampling import RUN_KEY, SamplingRun

log = logging.getLogger(__name__)

DIFFUSION_PREFIX = "diffusion_model."
REFERENCE_SIDE_TOKENS = 64  # 1024 px / 16: the size KSampler's fixed shift is exact for


@dataclass
class Qwen21Chunks:
    """What one model call's batch is made of: one conditioning per chunk of equal rows, in ComfyUI's order."""

    conds: list


class Qwen21Cond(comfy.conds.CONDConstant):
    """One CONDITIONING entry as our Conditioning. Any two batch together (the model splits the batch again)."""

    def can_concat(self, other):
        return isinstance(other, Qwen21Cond)

    def concat(self, others):
        return Qwen21Chunks([self.cond, *(other.cond for other in others)])

    def size(self):
        return [1]


def _model_config(pipe):
    class Qwen21Config(comfy.supported_models_base.BASE):
        unet_extra_config = {}
        sampling_settings = {"shift": resolution_shift(REFERENCE_SIDE_TOKENS**2, pipe.scheduler_config)}
        latent_format = comfy.latent_formats.LatentFormat  # replaced by the model's own (the VAE's mean and std)
        memory_usage_factor = 0.0  # our memory_required counts what a run allocates
        supported_inference_dtypes = [torch.bfloat16, torch.float16, torch.float32]

    config = Qwen21Config({"disable_unet_model_creation": True})  # the diffusion model is ours
    config.unet_config = TransformerConfig(config.unet_config)
    return config


@stable_name
class UNetPatchError(KeyError):
    """A node read a UNet's setting from our model's config (FreeU and the like): such patches cannot apply."""

    def __str__(self) -> str:  # a KeyError shows its key quoted; this is a message
        return str(self.args[0])


class TransformerConfig(dict):
    """The model config's `unet_config`: nodes that patch a UNet read its settings by key (FreeU reads
    'model_channels'); ours has none, and such a read is refused by name (a KeyError, as those nodes expect)."""

    def __missing__(self, key):
        raise UNetPatchError(f"Qwen21 MODEL: this node reads {key!r} of a UNet model's config (FreeU and other UNet "
                             "patches do); Qwen-Image-2.1's diffusion model is a transformer, where such patches "
                             "cannot apply: remove the node")  # fmt: skip


class Qwen21ComfyModel(comfy.model_base.BaseModel):
    """load_vae: places the VAE (the handle's memory adapter) before a control image is encoded for a run."""

    def __init__(self, pipe, fit_rgb, device=None, load_vae=None):
        super().__init__(_model_config(pipe), model_type=comfy.model_base.ModelType.FLUX, device=device)
        self.load_vae = load_vae or (lambda: None)
        log.info("Qwen21 MODEL: Qwen-Image-2.1 on the qwen21-nodes engine (ComfyUI's 'model_type FLUX' above names "
                 "its flow-matching sampling, as for native Qwen-Image; no FLUX model is loaded)")  # fmt: skip
        vae = pipe.vae.config
        self.latent_format = self.model_config.latent_format = Qwen21LatentFormat(vae.latents_mean, vae.latents_std,
                                                                                 fit_rgb)  # fmt: skip
        self.diffusion_model = Qwen21Diffusion(pipe)
        size_empty_latents()  # ComfyUI's Empty Latent Image gives the size asked for with this model
        self.memory_usage_factor_conds = ()
        self._lora_view = None
        self._converted: tuple = (None, ())  # (patches_uuid, ComfyUI's patches as our stack)

    @property
    def pipe(self):
        return self.diffusion_model.pipe

    # ---- conditioning ---------------------------------------------------------------------------------------

    def extra_conds(self, **kwargs):
        noise = kwargs.get("noise")
        channels = self.pipe.transformer.config.in_channels
        if noise is not None and noise.shape[1] != channels:
            raise ValueError(f"Qwen21 MODEL: the LATENT has {noise.shape[1]} channels; Qwen-Image-2.1 latents have "
                             f"{channels} (use Qwen21 Encode's latent output, Qwen21 VAE Encode, or VAE Encode with "
                             "the Qwen21 VAE)")  # fmt: skip
        return {"qwen21": Qwen21Cond(conditioning_from_entry(kwargs, self.pipe))}

    def extra_conds_shapes(self, **kwargs):
        """The prefix length of each conditioning (text rows and 4 rows per image slot): what memory_required sizes
        the K/V caches with. A negative left unencoded (the guidance does not use it) takes no room."""
        context = kwargs.get("cross_attn")
        if context is None or context.dim() != 3 or unencoded_negative(kwargs) is not None:
            return {}
        rows = context.shape[1]
        latents = kwargs.get("reference_latents") or ()
        rows += sum(math.prod(latent.shape[-2:]) for latent in latents)
        return {"qwen21_prefix": [1, rows]}

    def memory_required(self, input_shape, cond_shapes={}):  # noqa: B006 - ComfyUI's signature
        """Device bytes a sampling run needs beside the weights (memory/sizing.py): the prefix K/V of the
        conditionings (two branches when ComfyUI asks for a doubled batch, its CFG estimate), a step's activations
        (a GGUF DiT's dequantised weights too), for the K/V on the GPU (the larger placement); in a run with
        Fun-Control the branch's caches and activations too (its weights ComfyUI counts as the additional model's):
        our OUTER_SAMPLE wrapper sets RUN_CONTROL_SIZING around the run, since ComfyUI passes only shapes."""
        prefixes = [shape[-1] for shape in cond_shapes.get("qwen21_prefix", [])] or [1]
        rows, _, h, w = input_shape[:4]
        branches = sorted(prefixes, reverse=True)[: 2 if len(prefixes) > 1 else 1]
        batch = max(1, rows // len(branches))
        options = self.diffusion_model.options_for({})
        control_layers, plain_beside = RUN_CONTROL_SIZING.get()
        caches, activations = memory_adapter.job_bytes(self.pipe.transformer.config, self.pipe.dtype, branches,
                                                       h * w, batch, options.kv_cache, options.kv_layout,
                                                       control_layers=control_layers,
                                                       plain_beside=plain_beside)  # fmt: skip
        return caches["gpu"] + activations + memory_adapter.gguf_transient_bytes(self.pipe.transformer)

    # ---- LoRAs ----------------------------------------------------------------------------------------------

    def apply_lora_stack(self, ours: tuple, patches: dict, patches_uuid) -> None:
        """Bring the weights to our LoRA node's stack (`ours`) followed by ComfyUI's weight patches, through our
        merge in one call (the patcher calls it when it loads). ComfyUI's patches are converted once per patch
        set."""
        if self._converted[0] != patches_uuid:
            self._converted = (patches_uuid, tuple(comfy_patches_as_stack(patches, self.lora_slots(), patches_uuid)))
        self.pipe.set_loras((*ours, *self._converted[1]))

    def lora_slots(self) -> dict:
        """Every LoRA-addressable layer (checkpoint names, and the fused to_qkv / gate_up) -> where its weight lives
        (lora/merge.py LayerSlot). Found once: the names and rows do not change with where the weights are."""
        if self._lora_view is None:
            self._lora_view = lora_layers(self.pipe.transformer)
        return self._lora_view

    def state_dict(self, *args, **kwargs):
        """A view for ComfyUI's LoRA key map (comfy/lora.py reads only the names): `diffusion_model.<layer>.weight`
        per LoRA-addressable layer, as meta tensors of its shape. The weights themselves stay ours (quantised ones
        have no single float tensor); ComfyUI's LoRA patches land in them through our merge."""
        return {f"{DIFFUSION_PREFIX}{name}.weight": torch.empty(slot.shape, device="meta", dtype=self.pipe.dtype)
                for name, slot in self.lora_slots().items()}  # fmt: skip

    def state_dict_for_saving(self, *args, **kwargs):
        raise ValueError("a Qwen21 MODEL cannot be saved as a checkpoint (its weights are in our own layout and may "
                         "be quantised); save the LoRA or the workflow instead")  # fmt: skip


class Qwen21Diffusion(torch.nn.Module):
    """The diffusion model ComfyUI calls: (x, sigma, our conditions) -> velocity, through the sampling run's
    `SamplingRun`, which ComfyUI hands over in `transformer_options`."""

    def __init__(self, pipe):
        super().__init__()
        self.transformer = pipe.transformer  # a child module: ComfyUI's model walks see our weights
        self.__dict__["pipe"] = pipe  # not a child: the pipeline is not a module

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def transformer_blocks(self):
        """The DiT's blocks, by the name native ComfyUI's model has them (its Fun ControlNet node counts them)."""
        return self.transformer.transformer_blocks

    def options_for(self, transformer_options: dict) -> SampleOptions:
        """Sampling options from the model options: ours (the Qwen21 Options node) or native ComfyUI's prefix-cache
        node (QwenImage21Cache: device auto/gpu/cpu/off, dtype default/int8/int4)."""
        ours = transformer_options.get("qwen21_options")
        if isinstance(ours, SampleOptions):
            return ours
        native = transformer_options.get("qwen_image21_cache") or {}
        changes = {}
        device = native.get("device", "auto")
        if device == "off":
            changes["prefix_cache"] = False
        elif device in ("auto", "gpu", "cpu"):
            changes["kv_placement"] = device
        dtype = native.get("dtype", "default")
        if dtype in ("int8", "int4"):
            if dtype == "int4":
                log.warning("Qwen21: the prefix cache has no int4 format; int8 is used (QwenImage21Cache dtype int4)")
            changes["kv_cache"] = "int8"
        return SampleOptions(**changes)

    def forward(self, x, timestep, context=None, control=None, transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward,
            self,
            comfy.patcher_extension.get_all_wrappers(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                                                     transformer_options),  # fmt: skip
        ).execute(x, timestep, context, control, transformer_options, **kwargs)

    def _forward(self, x, timestep, context=None, control=None, transformer_options={}, qwen21=None,  # noqa: B006
                 **kwargs):  # fmt: skip
        refuse_patches(control, transformer_options)
        if not isinstance(qwen21, Qwen21Chunks):
            raise ValueError("Qwen21 MODEL: this model call has no Qwen-Image-2.1 conditioning (a CONDITIONING from "
                             "Qwen21 Encode or native TextEncodeQwenImage21 is needed)")  # fmt: skip
        chunks = qwen21.conds
        if x.shape[0] % len(chunks):
            raise ValueError(f"Qwen21 MODEL: a batch of {x.shape[0]} rows cannot split into {len(chunks)} conditions")
        sides = list(transformer_options.get("cond_or_uncond") or [])
        roles = [("negative" if side == 1 else "positive") for side in sides] if len(sides) == len(chunks) else (
            ["positive"] * len(chunks))  # fmt: skip
        options = self.options_for(transformer_options)
        control = control_option(transformer_options)
        run = transformer_options.get(RUN_KEY)
        if isinstance(run, SamplingRun):
            return run.velocity(self.pipe, x, timestep, chunks, roles, options, control)
        # a call from outside ComfyUI's sampling (a node calling the model itself): a run of its own, one call long
        run = SamplingRun(guided=len(set(roles)) > 1, rows=x.shape[0] // len(chunks))
        try:
            return run.velocity(self.pipe, x, timestep, chunks, roles, options, control)
        finally:
            run.close()


def refuse_patches(control, transformer_options: dict) -> None:
    """ControlNets and block patches hook into native ComfyUI's block code; ours runs fused blocks from cached
    K/V and CUDA graphs, where they cannot apply. Refused by name instead of ignored."""
    if control is not None:
        raise ValueError("Qwen21 MODEL: ControlNets cannot apply to our DiT (it runs its own fused blocks); remove "
                         "the ControlNet or use native ComfyUI's Qwen-Image-2.1 model for it")  # fmt: skip
    replaced = {name for name, patches in (transformer_options.get("patches_replace") or {}).items() if patches}
    patched = {name for name, patches in (transformer_options.get("patches") or {}).items() if patches}
    if replaced or patched:
        raise ValueError(f"Qwen21 MODEL: model patches {sorted(replaced | patched)} cannot apply to our DiT (it runs "
                         "its own fused blocks); remove the node that adds them (attention or block patches, "
                         "step caches that replace blocks)")  # fmt: skip
