"""`Qwen21Pipeline`: the core API that nodes, tests and benchmarks call.

    pipe = Qwen21Pipeline.from_pretrained(path, device=None, dtype=torch.bfloat16)
    cond = pipe.encode(prompt, images=(), negative_prompt=None, output_resolution=1024)
    latents = pipe.sample(cond, steps=40, seed=0)     # raw VAE-space [B, 64, H/16, W/16]
    images = pipe.decode(latents)                      # [B, H, W, 4] RGBA in 0..1

Long-lived state (weights, graphs, caches) hangs off the pipeline; `release()` drops what can be rebuilt. Options
default to the exact path; faster, non-identical paths must be asked for. Each question goes to its own module:
encoding.py, memory/, request.py and sampler.py, lora/, vae/calls.py, parallel/ (workers on other devices).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .conditioning import Conditioning
from .config import PipelineConfig, SchedulerConfig
from .control import Control, ControlContexts, control_context
from .dit.control import FunControlNet
from .dit.decode_graphs import DecodeGraphs
from .dit.prefill_graphs import PrefillGraphs
from .dit.transformer import QwenImage21Transformer
from .encoding import PrefixMemoryBudget, encode_conditioning, encode_negative, prefix_budget
from .lora.files import ReadLoras
from .lora.merge import LoraMerger, Stack, originals_for
from .lora.reading import LoraFile
from .memory import sizing
from .memory.manager import OwnPlacement, text_encoder_placed
from .memory.pinned_buffers import HOST_KV_BUFFERS
from .memory.planner import SamplingPlan, plan_for_transformer
from .options import SampleOptions
from .quant.gguf_prefetch import gguf_transient_bytes
from .quant.plan import WeightFormats
from .reference_cache import ReferenceCache
from .request import SampleRequest
from .sampler import Sampler
from .startup import model_warmup
from .vae import calls as vae_calls
from .velocity import VelocityRun

if TYPE_CHECKING:
    from .parallel.pool import WorkerPool
    from .startup.warmup import KernelWarmup

log = logging.getLogger(__name__)


class Qwen21Pipeline:
    workers: WorkerPool | None = None  # other devices with the same DiT (start_workers)
    check_interrupted: Callable[[], None] | None = None  # the host's Cancel: raises to stop a wait (from_pretrained)

    def __init__(self, transformer: QwenImage21Transformer, vae, text_encoder, scheduler_config: SchedulerConfig,
                 pipeline_config: PipelineConfig | None = None, *, text_encoder_offload: bool = True,
                 sources: dict | None = None):  # fmt: skip
        self.transformer, self.vae, self.text_encoder = transformer, vae, text_encoder
        self.scheduler_config = scheduler_config
        self.pipeline_config = pipeline_config or PipelineConfig()
        self.text_encoder_offload = text_encoder_offload
        self.sources = sources or {}
        # where work runs, fixed at load: a host (ComfyUI) may move the weights off and back in between
        self.execution_device = transformer.device
        self.text_encoder_device = text_encoder.device if text_encoder is not None else transformer.device
        self.vae_execution_device = vae_calls.vae_device(vae)
        self.decode_graphs = DecodeGraphs(transformer)
        self.prefill_graphs = PrefillGraphs(transformer)  # with decode graphs: the CUDA-graph option covers both
        self.references = ReferenceCache()  # condition images seen before: resized copies and latents
        # the pinned K/V buffers kept for the next host cache outlive a DiT's unloading, not the pipeline
        weakref.finalize(self, HOST_KV_BUFFERS.clear).atexit = False
        self.memory = OwnPlacement()  # the budget, and who places the weights: the nodes set their memory manager
        self.loras = LoraMerger(transformer, originals_for(self.sources.get("transformer", {}).get("path")))
        self.lora_stack: tuple = ()  # ((path, identity, strength), ...) merged now: what the workers merge too
        self.read_loras = ReadLoras()
        self.weight_formats = WeightFormats()  # how the DiT was loaded (a worker loads it the same way)
        self.workers = None
        self.last_sample_stats: dict = {}
        self.last_decode_stats: dict = {}
        self.kernel_warmup: KernelWarmup | None = None
        self.control_contexts = ControlContexts()  # control images encoded for a size (control.py)

    @classmethod
    def from_pretrained(cls, source, device=None, dtype: torch.dtype = torch.bfloat16, **options) -> Qwen21Pipeline:
        """Load a diffusers folder or a dict of ComfyUI single files. options: the load's keywords (component dtypes
        and devices, weight formats, text_encoder_offload, check_interrupted): see checkpoints/loading.py
        load_pipeline."""
        from .checkpoints.loading import load_pipeline

        return load_pipeline(cls, source, device, dtype, **options)

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def vram_budget(self) -> int | None:
        """The one budget every plan of this pipeline uses (bytes of the device; None: what it has)."""
        return self.memory.budget

    @property
    def manage_weights(self) -> bool:
        return self.memory.places_weights

    def start_kernel_warmup(self) -> KernelWarmup | None:
        """Compile our Triton kernels for these models in background threads (startup/model_warmup.py)."""
        if self.kernel_warmup is None:
            self.kernel_warmup = model_warmup.start(self)
        return self.kernel_warmup

    # ---- encode -----------------------------------------------------------------------------------
    def encode(self, prompt: str, images: Sequence = (), masks=None, negative_prompt: str | None = None,
               output_resolution: int = 1024, width: int | None = None, height: int | None = None) -> Conditioning:
        """Encode a prompt with its condition images. Images: ComfyUI IMAGE, PIL or numpy. The negative prompt
        is encoded later, by `sample` at true_cfg_scale > 1 (see `encode_negative`)."""
        with_images = images is not None and len(images) > 0  # condition images go through the VAE encoder
        with model_warmup.encoding(self.kernel_warmup, with_images), self._text_encoder_placed():
            return encode_conditioning(self.text_encoder, self.vae, prompt, images=images, masks=masks,
                                       negative_prompt=negative_prompt, output_resolution=output_resolution,
                                       width=width, height=height, memory_budget=self._prefix_budget(),
                                       references=self.references)  # fmt: skip

    def encode_negative(self, cond: Conditioning) -> Conditioning:
        """Encode `cond`'s pending negative prompt (once: later calls, and conditionings without one, do
        nothing). `sample` calls it when true_cfg_scale > 1; the text encoder comes back if it was offloaded."""
        if cond.negative_pending is None:
            return cond
        with self._text_encoder_placed():
            return encode_negative(self.text_encoder, cond, memory_budget=self._prefix_budget())

    def _text_encoder_placed(self):
        return text_encoder_placed(self.text_encoder, self.text_encoder_device, self.manage_weights,
                                   self.text_encoder_offload)  # fmt: skip

    def _prefix_budget(self) -> PrefixMemoryBudget | None:
        leaving = self.text_encoder if self.text_encoder_offload else None  # its weights are free after encoding
        return prefix_budget(self.transformer.config, self.dtype, self.execution_device, self.vram_budget, leaving)

    # ---- memory of a run ----------------------------------------------------------------------------
    def sampling_bytes(self, cond: Conditioning, request: SampleRequest, options: SampleOptions | None = None,
                       kv_placement: str | None = None) -> int:  # fmt: skip
        """Device memory a run of `request` needs beyond the weights (memory/sizing.py sampling_bytes; a GGUF DiT's
        dequantised weights of a step too)."""
        needed = sizing.sampling_bytes(self.transformer.config, self.dtype, cond, request, options, self.workers,
                                       kv_placement)  # fmt: skip
        return needed + gguf_transient_bytes(self.transformer)

    def plan_sampling(self, cond, request: SampleRequest, options: SampleOptions) -> SamplingPlan:
        """Where this run's prefix K/V go and how many DiT blocks stay resident, from the memory available now
        (memory/planner.py plan_for_transformer)."""
        caches, activations = sizing.request_bytes(self.transformer.config, self.dtype, cond, request, options,
                                                   self.workers)  # fmt: skip
        activations += gguf_transient_bytes(self.transformer)
        return plan_for_transformer(self.transformer, self.device, self.vram_budget, self.idle_cache_bytes(), caches,
                                    activations, self.manage_weights, options.kv_placement)  # fmt: skip

    # ---- sample -----------------------------------------------------------------------------------
    def sample(self, cond: Conditioning | Sequence[Conditioning], height: int | None = None, width: int | None = None,
               steps: int = 40, true_cfg_scale: float = 1.0, seed: int = 0, noise: torch.Tensor | None = None,
               batch_size: int = 1, sigmas: Sequence[float] | None = None, callback: Callable | None = None, *,
               schedule: str = "default", start_latents: torch.Tensor | None = None, denoise: float = 1.0,
               options: SampleOptions | None = None, control: Control | None = None) -> torch.Tensor:  # fmt: skip
        """Denoise; returns raw VAE-space latents [B, 64, H/16, W/16] (float32, on the pipeline's device).
        cond:    one Conditioning or several (batched request-major: rows [c0 x batch, c1 x batch, ...]).
        options: how it runs (prefix cache, decode graphs, compile, attention backend): see SampleOptions.
        The other arguments are what it makes: see SampleRequest (`sample_request` takes one).
        """
        request = SampleRequest(height=height, width=width, steps=steps, true_cfg_scale=true_cfg_scale, seed=seed,
                                noise=noise, batch_size=batch_size, sigmas=sigmas, schedule=schedule,
                                start_latents=start_latents, denoise=denoise, callback=callback,
                                control=control)  # fmt: skip
        return self.sample_request(cond, request, options)

    def sample_request(self, cond: Conditioning | Sequence[Conditioning], request: SampleRequest,
                       options: SampleOptions | None = None) -> torch.Tensor:  # fmt: skip
        """`sample` with what it makes in one SampleRequest."""
        options = options or SampleOptions()
        conds = [cond] if isinstance(cond, Conditioning) else list(cond)
        if not conds:
            raise ValueError("sample needs at least one conditioning")
        request = request.sized(conds[0])
        if request.guided:
            for c in conds:
                self.encode_negative(c)  # encoded only now that guidance needs it (a no-op once encoded)
        request = request.replace(sigmas=request.base_sigmas(self.pipeline_config.sample_sigmas))
        every_row = request.replace(batch_size=request.batch_size * len(conds))  # the plan holds them all
        context = self.control_context(request.control, request.latent_size) if request.controlled else None
        sampler, plan = self._sampler(conds[0], every_row, options, self.workers, context)
        try:
            return sampler.sample_request(conds, request)
        finally:
            self._finish(sampler, plan)

    def _sampler(self, cond, request: SampleRequest, options, workers,
                 control_context: torch.Tensor | None = None) -> tuple[Sampler, SamplingPlan]:  # fmt: skip
        """A Sampler for one run, after what it needs is ready: the kernels the first step uses, the blocks
        compiled or not, and the memory plan (where the prefix K/V go, how many blocks stay resident)."""
        model_warmup.before_sampling(self.kernel_warmup)
        self.transformer.compile_blocks(options.compile_blocks)
        plan = self.plan_sampling(cond, request, options)
        if self.manage_weights:
            self.transformer.stream_blocks(plan.resident_blocks)
            if request.controlled and request.control.net.device != self.device:
                request.control.net.place(self.device)
        log.info("sampling plan: %s", plan.reason)
        runner = self.decode_graphs if options.decode_graphs and self.device.type == "cuda" else None
        self.prefill_graphs.budget = self.vram_budget  # a capture takes room under the same budget
        sampler = Sampler(self.transformer, self.scheduler_config, torch.tensor(self.vae.config.latents_mean),
                          torch.tensor(self.vae.config.latents_std), options=options, kv_placement=plan.kv_placement,
                          decode_runner=runner, prefill_runner=self.prefill_graphs if runner is not None else None,
                          workers=workers, lora_stack=self.lora_stack,
                          control_context=control_context)  # fmt: skip
        return sampler, plan

    # ---- control ----------------------------------------------------------------------------------
    def load_control(self, path, weight_format: str = "auto", device=None) -> FunControlNet:
        """A Fun-Controlnet-Union file -> the control branch for this DiT (checkpoints/loading.py load_fun_control),
        on `device` (default: the DiT's), in the DiT's compute dtype; weight_format as the DiT's."""
        from .checkpoints.loading import load_fun_control

        net, info = load_fun_control(path, self.transformer.config, device or self.device, self.dtype, weight_format)
        log.info("Fun-Control loaded from %s: %s blocks, %s", info["path"], info["blocks"], info["weights"])
        return net

    def control_context(self, control: Control, latent_size) -> torch.Tensor:
        """The [h * w, 129] context of `control` for an output of `latent_size`, encoded once per control and size
        (control.py)."""
        vae = self.vae.config
        return self.control_contexts.get(control, latent_size, lambda: control_context(
            control, lambda images: self.encode_image(images), torch.tensor(vae.latents_mean),
            torch.tensor(vae.latents_std), latent_size))  # fmt: skip

    def _finish(self, sampler: Sampler, plan: SamplingPlan) -> None:
        """After a run: its stats (with what the graphs did) kept for the node's status, the graph entries idle."""
        self.last_sample_stats = sampler.graph_stats().as_dict() | {"plan": plan.reason}
        self.decode_graphs.end_generation()
        self.prefill_graphs.end_generation()

    def velocity_run(self, cond: Conditioning, height: int, width: int, rows: int, guided: bool = False,
                     options: SampleOptions | None = None, control: Control | None = None) -> VelocityRun:  # fmt: skip
        """Velocities for another sampler's loop (ComfyUI's KSampler): see velocity.py. `cond`, the size, the rows
        of one call and whether a negative branch runs beside (`guided`) say how much memory to plan for; several
        GPUs are not used (parallel off); `control`, if its calls may run controlled (sized for, and its weights
        placed). Close the run when the loop ends (`run.close()`): its stats become `last_sample_stats`."""
        options = (options or SampleOptions()).replace(parallel="off")
        # that loop's latents may be any multiple of 16 pixels: rounded up to the request's 32, they plan a bit more;
        # its guidance scale is its own (any value): the request only needs to know whether two branches run
        request = SampleRequest(height=-(-height // 32) * 32, width=-(-width // 32) * 32, batch_size=rows,
                                true_cfg_scale=2.0 if guided else 1.0, control=control)  # fmt: skip
        sampler, plan = self._sampler(cond, request, options, None)
        sampler.stats.prefix_cache = "on" if sampler.prefix_cache else "off"
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return VelocityRun(sampler, on_close=lambda closed: self._finish(closed, plan))

    # ---- LoRA -------------------------------------------------------------------------------------
    def load_lora(self, path, side_path: bool = False) -> LoraFile:
        """Read a LoRA file (kept as read: lora/files.py), checked against this DiT, not merged yet. side_path: on
        quantised weights run it beside them (exact, extra GEMMs per step), not merged (requantised): lora/merge.py."""
        return self.read_loras.load(path, self.transformer, side_path)

    def set_loras(self, stack: Stack) -> None:
        """Bring the weights to original + the (LoRA, strength) pairs of `stack`, merged in place; () removes all.
        Reversible bit for bit (lora/merge.py); weight addresses stay, so captured decode graphs stay valid."""
        self.loras.apply(stack, vram_budget=self.vram_budget)  # copies of originals stay within the budget
        self.lora_stack = tuple((str(lora.path), lora.identity, float(strength)) for lora, strength in stack)

    # ---- VAE --------------------------------------------------------------------------------------
    def decode(self, latents: torch.Tensor, **options) -> torch.Tensor:
        """Raw latents [B, 64, h, w] -> RGBA [B, 16h, 16w, 4] in 0..1. Options: see the VAE's decode."""
        images, self.last_decode_stats = vae_calls.decode(self.vae, latents, self.kernel_warmup, **options)
        return images

    def encode_image(self, images: torch.Tensor, masks: torch.Tensor | None = None, **options) -> torch.Tensor:
        """ComfyUI IMAGE [B, H, W, 3|4] (+ MASK [B, H, W] = 1 - alpha) -> raw latents [B, 64, H/16, W/16]."""
        return vae_calls.encode(self.vae, images, masks, self.kernel_warmup, **options)

    @property
    def vae_device(self) -> torch.device:
        return vae_calls.vae_device(self.vae)

    # ---- lifetime ---------------------------------------------------------------------------------
    def idle_cache_bytes(self) -> int:
        """Device bytes of K/V caches kept from earlier runs (graph entries, workers') that the next run gets back."""
        kept = self.workers.idle_cache_bytes if self.workers is not None else 0
        return self.decode_graphs.idle_cache_bytes() + kept

    def release_device_caches(self):
        """Free what reads the DiT's weights by address (the graphs, with their K/V), the workers' kept caches and
        cached memory, as a memory manager does when the DiT leaves the device. References and pinned K/V buffers stay:
        where the DiT leaves for every encode (a small card), each edit would otherwise resize, encode, pin again."""
        entries = len(self.decode_graphs.entries) + len(self.prefill_graphs.entries)
        self.decode_graphs.clear()
        self.prefill_graphs.clear()
        if self.workers is not None:
            self.workers.release()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.info("Qwen21 released %d decode and prefill graph entries and cached memory (weights kept)", entries)

    def release(self):
        """Free all that can be rebuilt (an out-of-memory retry): the device caches, references, pinned K/V buffers."""
        self.references.clear()
        HOST_KV_BUFFERS.clear()
        self.release_device_caches()

    # ---- several devices ----------------------------------------------------------------------------------
    def start_workers(self, devices: Sequence, recipe=None, **pool_options) -> WorkerPool:
        """Run the DiT on `devices` too (a worker process each, ranks 1..N; this process is rank 0), to split sampling
        over them as `SampleOptions.parallel` says. recipe: how a worker builds the same DiT (parallel/recipes.py;
        default: this pipeline's checkpoint, dtype and formats). They stop with `stop_workers`, the pipeline or exit."""
        from .parallel.pool import WorkerPool
        from .parallel.recipes import recipe_for

        self.stop_workers()
        recipe = recipe or recipe_for(self.sources, self.dtype, self.weight_formats)
        self.workers = WorkerPool.start([torch.device(d) for d in devices], recipe, self.device, **pool_options)
        weakref.finalize(self, self.workers.shutdown)
        return self.workers

    def stop_workers(self) -> None:
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None
