"""The denoising loop behind `Qwen21Pipeline.sample`.

Per conditioning (requests are processed in order, request-major) and per CFG branch: build the
sequence layout, allocate the branch's K/V cache, prefill the prefix once (shared by every row of the
batch), then run Euler steps that decode the target tokens only. Latents live in the DiT's
normalised space inside the loop and leave it as raw VAE-space latents [B, 64, H/16, W/16].
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .conditioning import Conditioning, PromptEmbedding
from .config import SchedulerConfig
from .control import active_steps
from .dit.sequence import build_layout
from .dit.transformer import Branch, QwenImage21Transformer
from .options import SampleOptions
from .parallel.modes import parallel_mode
from .request import SampleRequest
from .scheduler import euler_step, partial_schedule, step_percents

log = logging.getLogger(__name__)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h*w, C] (a plain spatial flatten; 2.1 is not patchified)."""
    return latents.flatten(2).transpose(1, 2)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h*w, C] -> [B, C, h, w]."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], tokens.shape[2], h, w)


def condition_tokens(cond: Conditioning) -> torch.Tensor | None:
    """Every condition image's latent tokens, packed and concatenated in slot order: [I, C] (None without images)."""
    if not cond.condition_latents:
        return None
    return torch.cat([pack(lat[None].float())[0] for lat in cond.condition_latents])


def model_timestep(sigma: torch.Tensor, dtype: torch.dtype, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The DiT's t for `sigma`, rounded as the reference rounds it: the timestep (sigma * 1000, fp32) cast to the
    compute dtype, then divided by 1000."""
    return (sigma.to(torch.float32) * num_train_timesteps).to(dtype) / num_train_timesteps


def make_noise(seed: int, shape, generator_device="cpu") -> torch.Tensor:
    """ComfyUI's convention: one fp32 randn of the whole latent batch from a CPU generator."""
    generator = torch.Generator(generator_device).manual_seed(int(seed))
    return torch.randn(shape, generator=generator, dtype=torch.float32, device=generator_device)


@dataclass
class SampleStats:
    """What the last `sample` did, for logs and the canvas status line."""

    steps: int = 0
    seconds: float = 0.0
    prefills: int = 0
    prefix_tokens: int = 0
    prefix_cache: str = "off"  # "on" | "off" | "reused"
    cache_bytes: int = 0
    cache_host_bytes: int = 0
    kv_cache: str = ""
    decode_graph: str = "off"
    prefill_graph: str = "off"
    peak_vram_bytes: int = 0
    branch_setup_s: float = 0.0  # the host's time making the branches: K/V caches (pinned host RAM too), tables
    replayed_steps: int = 0  # decode steps replayed from a CUDA graph
    parallel: str = "off"  # e.g. "sequence over 2 ranks" (parallel/)
    control: str = "off"  # e.g. "12/20 steps at strength 1.0" (a Fun-Control's steps)
    ranks: list = field(default_factory=list)  # each worker's part: cache, peak VRAM, decode graphs

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
            "steps_per_second": round(self.steps_per_second, 3),
            "prefills": self.prefills,
            "branch_setup_s": round(self.branch_setup_s, 3),
            "prefix_tokens": self.prefix_tokens,
            "prefix_cache": self.prefix_cache,
            "prefix_cache_mib": round(self.cache_bytes / 2**20, 1),
            "prefix_cache_host_mib": round(self.cache_host_bytes / 2**20, 1),
            "kv_cache": self.kv_cache,
            "decode_graph": self.decode_graph,
            "replayed_steps": self.replayed_steps,
            "prefill_graph": self.prefill_graph,
            "peak_vram_mib": round(self.peak_vram_bytes / 2**20, 1),
            "parallel": self.parallel,
            "control": self.control,
            "ranks": self.ranks,
        }


class Sampler:
    """Runs one `sample` call. Holds nothing after it returns (branches and caches are released)."""

    def __init__(
        self,
        transformer: QwenImage21Transformer,
        scheduler_config: SchedulerConfig,
        latents_mean: torch.Tensor,
        latents_std: torch.Tensor,
        *,
        options: SampleOptions | None = None,
        kv_placement: str = "gpu",
        decode_runner=None,
        prefill_runner=None,
        workers=None,
        lora_stack: tuple = (),
        control_context: torch.Tensor | None = None,
    ):
        self.transformer = transformer
        self.scheduler_config = scheduler_config
        self.mean = latents_mean.to(torch.float32).reshape(1, -1, 1, 1)
        self.std = latents_std.to(torch.float32).reshape(1, -1, 1, 1)
        self.options = options or SampleOptions()
        self.prefix_cache = self.options.prefix_cache
        self.attention_backend = self.options.attention_backend
        self.kv = self.options.kv_spec(kv_placement)  # the pipeline resolves "auto" placement from free memory
        self.decode_runner = decode_runner  # e.g. the CUDA-graph manager; None = eager decode
        self.prefill_runner = prefill_runner  # e.g. the prefill graphs (dit/prefill_graphs.py); None = eager prefill
        self.workers = workers  # a parallel.pool.WorkerPool: other devices holding the same DiT; None = this one only
        self.lora_stack = lora_stack  # ((path, identity, strength), ...) merged into the weights (for the workers)
        self.control_context = control_context  # [N, 129] for the request's control (the pipeline prepares it)
        self.stats = SampleStats()

    # ---- public ---------------------------------------------------------------------------------

    def sample(self, conditionings: list[Conditioning], **request) -> torch.Tensor:
        """`sample_request` with the request's fields as keywords (SampleRequest)."""
        return self.sample_request(conditionings, SampleRequest(**request))

    def sample_request(self, conditionings: list[Conditioning], request: SampleRequest) -> torch.Tensor:
        """Denoise `request.batch_size` rows per conditioning, request-major; returns raw VAE-space latents. The
        request's sigmas are the base grid as given: a schedule other than "default" must be resolved to its sigmas
        first (SampleRequest.base_sigmas, which the pipeline calls with its checkpoint's)."""
        if not conditionings:
            raise ValueError("sample needs at least one conditioning")
        if request.sigmas is None and request.schedule != "default":
            raise ValueError(f"schedule {request.schedule!r} is not resolved to sigmas: pass "
                             "request.replace(sigmas=request.base_sigmas(the checkpoint's sample_sigmas))")  # fmt: skip
        request = request.sized(conditionings[0])
        h, w = request.latent_size
        batch_size = request.batch_size
        channels = self.transformer.config.in_channels
        shape = (len(conditionings) * batch_size, channels, h, w)
        noise, start_latents = request.noise, request.start_latents
        if noise is not None and tuple(noise.shape) != shape:
            raise ValueError(f"noise must have the latent shape {list(shape)}, got {list(noise.shape)}")
        if start_latents is not None and start_latents.shape[-2:] != (h, w):
            raise ValueError(
                f"the input LATENT is {start_latents.shape[-2] * 16}x{start_latents.shape[-1] * 16} px but the "
                f"sampler is set to {request.height}x{request.width}; set width/height to 0 to follow the LATENT"
            )
        denoise = request.denoise if start_latents is not None else 1.0
        # the schedule's limits are checked before the noise is drawn (values may come through links)
        schedule_sigmas, timesteps = partial_schedule(self.scheduler_config, h * w, request.steps, denoise,
                                                      request.sigmas)  # fmt: skip
        if noise is None:
            noise = make_noise(request.seed, shape)
        device = self.transformer.device
        self.stats = SampleStats(steps=len(timesteps), prefix_cache="on" if self.prefix_cache else "off")
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        outputs = []
        for index, cond in enumerate(conditionings):
            row_slice = slice(index * batch_size, (index + 1) * batch_size)
            start = None if start_latents is None else self._expand(start_latents, batch_size, index)
            outputs.append(self._sample_one(cond, noise[row_slice], start, schedule_sigmas, timesteps, request, index,
                                            len(conditionings)))  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self.stats.peak_vram_bytes = torch.cuda.max_memory_allocated(device)
        self.stats.seconds = time.perf_counter() - started
        return torch.cat(outputs)

    def graph_stats(self) -> SampleStats:
        """The stats with what the decode and prefill graphs did in the run (or why they were off)."""
        stats, runner = self.stats, self.decode_runner
        if stats.parallel.startswith("sequence"):
            pass  # the run said why its steps ran eagerly
        elif runner is not None:
            stats.decode_graph = runner.describe()
            stats.replayed_steps = runner.replays
            if self.prefill_runner is not None:
                stats.prefill_graph = self.prefill_runner.describe()
        elif not self.options.decode_graphs:
            stats.decode_graph = "off: disabled"
        else:
            stats.decode_graph = f"off: needs CUDA (model on {self.transformer.device.type})"
        return stats

    # ---- internals ------------------------------------------------------------------------------

    @staticmethod
    def _expand(start_latents, batch_size, index):
        if start_latents.shape[0] == 1:
            return start_latents.expand(batch_size, -1, -1, -1)
        return start_latents[index * batch_size : (index + 1) * batch_size]

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw.float() - self.mean.to(raw.device)) / self.std.to(raw.device)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        return z.float() * self.std.to(z.device) + self.mean.to(z.device)

    def new_branch(self, cond: Conditioning, prompt: PromptEmbedding, role: str, target_shape, batch: int,
                   control=None, context: torch.Tensor | None = None) -> Branch:  # fmt: skip
        """One CFG branch of `cond` with `prompt`: its layout and K/V cache (a kept decode-graph entry's, if one is
        idle for the same key, which may still hold this prefix). control, context: a Fun-Control and its [N, 129]
        context: the branch runs the control blocks beside its own."""
        layout = build_layout(prompt.image_pad_mask, cond.image_shapes, target_shape)
        if self.decode_runner is not None:
            branch = self.decode_runner.new_branch(layout, batch, self.attention_backend, role, self.kv, control)
        else:
            branch = self.transformer.new_branch(layout, batch, self.attention_backend, self.kv, control=control)
        if control is not None:
            branch.control.set_context(context, control.identity)
        return branch

    def prefix_id(self, cond: Conditioning, role: str, control=None):
        """What a branch's prefix K/V depend on: the conditioning's content, the branch, the weights' dtype and the
        merged LoRAs, and a control's weights and strength (None: not reusable, a conditioning without a content
        hash)."""
        tr = self.transformer
        if not cond.content_hash:
            return None
        base = (cond.content_hash, role, str(tr.dtype), tr.weights_id)
        return base if control is None else (*base, control.prefix_key)

    def release_branch(self, branch: Branch) -> None:
        if self.decode_runner is not None:
            self.decode_runner.release(branch)
        else:
            branch.release()

    def _prefill(self, branch: Branch, prompt: PromptEmbedding, cond_tokens, prefix_id):
        self.stats.prefix_tokens = max(self.stats.prefix_tokens, branch.layout.prefix_len)
        cache = branch.cache
        if self.prefix_cache and prefix_id is not None and cache.filled and cache.prefix_id == prefix_id:
            self.stats.prefix_cache = "reused"  # a kept cache already holds this prefix (same conditioning)
            return
        cache.prefix_id = None
        # the prefill graphs hold the base's blocks only: a controlled prefix runs eagerly (once per conditioning)
        runner = self.prefill_runner if branch.control is None else None
        (runner or self.transformer.prefill)(branch, prompt.embeds, cond_tokens)
        cache.prefix_id = prefix_id
        self.stats.prefills += 1

    def _velocity(self, branch: Branch, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.decode_runner is not None:
            return self.decode_runner(branch, x, t)
        return self.transformer.decode(branch, x, t)

    def _sample_one(self, cond, noise, start, sigmas, timesteps, request: SampleRequest, index, count):
        tr = self.transformer
        device, dtype = tr.device, tr.dtype
        batch = noise.shape[0]
        cfg, callback = request.true_cfg_scale, request.callback
        if cfg > 1.0 and cond.negative is None and cond.negative_pending is not None:
            raise ValueError(
                "the conditioning's negative prompt is not encoded yet; sample through Qwen21Pipeline.sample, "
                "which encodes it for true_cfg_scale > 1, or call Qwen21Pipeline.encode_negative(cond) first"
            )
        use_cfg = cfg > 1.0 and cond.negative is not None
        if cfg > 1.0 and cond.negative is None:
            log.warning("true_cfg_scale=%s but the conditioning has no negative prompt: guidance is off", cfg)
        mode = parallel_mode(self.options.parallel, self.workers, use_cfg)
        control = request.control if request.controlled else None
        if control is not None and mode is not None:
            log.info("control runs on one GPU: parallel %s is off for this run", mode)
            mode = None
        target_shape = h, w = request.latent_size
        sigmas = sigmas.to(device)
        timesteps = timesteps.to(device)
        # moved once: a copy from pageable host memory at every step's denormalize made the host wait for the GPU
        self.mean, self.std = self.mean.to(device), self.std.to(device)

        x = noise.to(device)
        if start is not None:
            # flow matching: x_sigma = sigma * noise + (1 - sigma) * x0
            z0 = self.normalize(start.to(device))
            x = sigmas[0] * x + (1 - sigmas[0]) * z0
        x = pack(x).to(dtype)

        total = len(timesteps)
        controlled = [False] * total
        if control is not None:
            percents = step_percents(request.steps, request.denoise if start is not None else 1.0, request.sigmas)
            controlled = active_steps(percents, control.start, control.end)
            self.stats.control = f"{sum(controlled)}/{total} steps at strength {control.strength:g}"
        if mode is None:
            run = _LocalRun(self, cond, target_shape, batch, use_cfg, control, controlled)
        else:
            prefix_ids = [self.prefix_id(cond, role) for role in ("positive", "negative")[: 2 if use_cfg else 1]]
            run = _ParallelRun(self, cond, target_shape, batch, use_cfg, prefix_ids, mode)
        self.stats.kv_cache = self.kv.describe(dtype, device)
        try:
            for i in range(total):
                t = (timesteps[i].expand(batch).to(dtype)) / 1000
                with torch.profiler.record_function("qwen21 step"):  # profiler ranges: benchmarks/_trace.py
                    velocities = run.step(x, t, first=i == 0 or not self.prefix_cache, index=i)
                v = velocities[0]
                if use_cfg:
                    v_neg = velocities[1]
                    v = v_neg + cfg * (v - v_neg)
                x_prev = x
                x = euler_step(x, v, sigmas[i], sigmas[i + 1])
                if callback is not None:
                    x0 = x_prev.float() - sigmas[i] * v.float()
                    callback(index * total + i + 1, total * count, self.denormalize(unpack(x0, h, w)))
        finally:
            run.close()
        return self.denormalize(unpack(x, h, w))


class _LocalRun:
    """One conditioning's CFG branches in this process, one after another. With control, each CFG side has a
    controlled branch for the steps inside the control range and a plain one for the others (their prefixes differ:
    dit/control.py), each made at its first step and released after its last."""

    def __init__(self, sampler: Sampler, cond, target_shape, batch, use_cfg, control=None, controlled=()):
        self.sampler, self.cond, self.target_shape, self.batch = sampler, cond, target_shape, batch
        self.control = control
        prompts = [cond.positive] + ([cond.negative] if use_cfg else [])
        self.sides = list(zip(("positive", "negative"), prompts, strict=False))
        self.controlled = list(controlled)
        self.last_step = {on: max((i for i, c in enumerate(self.controlled) if c == on), default=-1)
                          for on in (False, True)}  # fmt: skip
        self.branches: dict = {}  # (side, controlled) -> Branch
        self.prefilled: set = set()
        self.cond_tokens = condition_tokens(cond)

    def _branch(self, side: int, controlled: bool) -> Branch:
        key = (side, controlled)
        branch = self.branches.get(key)
        if branch is None:
            sampler = self.sampler
            started = time.perf_counter()
            role, prompt = self.sides[side]
            control = self.control if controlled else None
            context = sampler.control_context if controlled else None
            branch = sampler.new_branch(self.cond, prompt, role, self.target_shape, self.batch, control, context)
            sampler.stats.branch_setup_s += time.perf_counter() - started
            sampler.stats.cache_bytes += branch.cache_bytes
            sampler.stats.cache_host_bytes += branch.cache_host_bytes
            self.branches[key] = branch
        return branch

    def step(self, x, t, first: bool, index: int = 0) -> list[torch.Tensor]:
        sampler = self.sampler
        controlled = bool(self.controlled[index]) if self.controlled else False
        velocities = []
        for side, (role, prompt) in enumerate(self.sides):
            branch = self._branch(side, controlled)
            key = (side, controlled)
            if first or key not in self.prefilled:
                prefix_id = sampler.prefix_id(self.cond, role, self.control if controlled else None)
                with torch.profiler.record_function("qwen21 prefill"):
                    sampler._prefill(branch, prompt, self.cond_tokens, prefix_id if sampler.prefix_cache else None)
                self.prefilled.add(key)
            velocities.append(sampler._velocity(branch, x, t))
            if self.control is not None and index >= self.last_step[controlled]:
                self._release(key)  # its last step: the other kind's cache may take its room
        return velocities

    def _release(self, key) -> None:
        branch = self.branches.pop(key, None)
        if branch is not None:
            self.sampler.release_branch(branch)

    def close(self) -> None:
        for key in list(self.branches):
            self._release(key)


class _ParallelRun:
    """One conditioning's run over the workers too (parallel/jobs.py): rank 0's part here, theirs by command."""

    def __init__(self, sampler: Sampler, cond, target_shape, batch, use_cfg, prefix_ids, mode: str):
        from .parallel.jobs import BranchInput, JobSpec

        self.sampler, self.mode = sampler, mode
        prompts = [cond.positive] + ([cond.negative] if use_cfg else [])
        roles = ("positive", "negative")
        inputs = [BranchInput(role, prompt.embeds.detach().cpu(), prompt.image_pad_mask.detach().cpu(), prefix_id)
                  for role, prompt, prefix_id in zip(roles, prompts, prefix_ids, strict=False)]  # fmt: skip
        cond_tokens = None
        if cond.condition_latents:
            cond_tokens = torch.cat([pack(lat[None].float().cpu())[0] for lat in cond.condition_latents])
        # the options as rank 0 runs them: its K/V placement, whether it replays graphs, compiled blocks or not
        options = sampler.options.replace(kv_placement=sampler.kv.placement, decode_graphs=sampler.decode_runner
                                          is not None, compile_blocks=sampler.transformer.compiled)  # fmt: skip
        spec = JobSpec(mode=mode, branches=inputs, image_shapes=list(cond.image_shapes), cond_tokens=cond_tokens,
                       target_shape=tuple(target_shape), batch=batch, options=options,
                       loras=tuple(sampler.lora_stack))  # fmt: skip
        graphs = sampler.decode_runner if mode == "cfg" else None
        self.run = sampler.workers.run(sampler.transformer, spec, graphs)
        stats = sampler.stats
        stats.prefix_tokens = max(stats.prefix_tokens, max(prompt.length for prompt in prompts) + 3 * sum(
            h * w // 4 for h, w in cond.image_shapes))  # fmt: skip
        stats.parallel = f"{mode} over {sampler.workers.world} ranks"
        if mode == "sequence":
            stats.decode_graph = "off: sequence-parallel steps run eagerly (collectives are not captured)"

    def step(self, x, t, first: bool, index: int = 0) -> list[torch.Tensor]:
        return self.run.step(x, t, first)

    def close(self) -> None:
        result = self.run.close()
        stats = self.sampler.stats
        stats.cache_bytes += result.get("cache_bytes", 0)
        stats.cache_host_bytes += result.get("cache_host_bytes", 0)
        prefills, reused = result.get("prefills", 0), result.get("reused", 0)
        if self.mode == "cfg":  # rank 1 holds the negative branch: its prefill counts too
            for worker in result["workers"]:
                prefills += worker.get("prefills", 0)
                reused += worker.get("reused", 0)
        stats.prefills += prefills
        if reused:
            stats.prefix_cache = "reused"
        stats.ranks = [{
            "prefix_cache_bytes": worker.get("cache_bytes", 0),
            "prefix_cache_mib": round(worker.get("cache_bytes", 0) / 2**20, 1),
            "peak_vram_mib": round(worker.get("peak_vram_bytes", 0) / 2**20, 1),
            "decode_graph": worker.get("decode_graph", "off") if self.mode == "cfg" else stats.decode_graph,
        } for worker in result.get("workers", [])]  # fmt: skip
