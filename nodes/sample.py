"""Sampler node: conditioning -> LATENT {"samples": [B, 64, H/16, W/16]} in raw VAE space."""

from __future__ import annotations

import logging
from itertools import pairwise

from ..qwen21_core.options import PARALLEL_MODES, SampleOptions
from ..qwen21_core.request import LATENT_SCALE, SampleRequest
from . import host
from .model import CONDITIONING_TYPE, MODEL_TYPE, sample_status
from .preview import latent_to_preview

log = logging.getLogger(__name__)

SCHEDULES = ("default", "turbo", "custom")


def parse_sigmas(text: str) -> list[float]:
    """'1.0, 0.75, 0.5, 0.25' -> the base grid the core takes: falling values in (0, 1], one per step.
    A trailing 0 (ComfyUI's sigma lists end with it) is the implied terminal value and is dropped."""
    try:
        sigmas = [float(part) for part in text.replace("\n", ",").split(",") if part.strip()]
    except ValueError as error:
        raise ValueError(f"sigmas must be comma-separated numbers like '1.0, 0.75, 0.5, 0.25', got {text!r}") from error
    if sigmas and sigmas[-1] == 0:
        sigmas = sigmas[:-1]
    if not sigmas:
        raise ValueError(f"sigmas needs at least one value in (0, 1], got {text!r}")
    if any(b >= a for a, b in pairwise(sigmas)) or sigmas[0] > 1 or sigmas[-1] <= 0:
        raise ValueError(f"sigmas must fall strictly within (0, 1] (a final 0 is implied), got {sigmas}")
    return sigmas


class Qwen21Sampler:
    """Denoise Qwen-Image-2.1 latents. Step 1 computes the prompt/condition prefix once and caches its
    K/V; later steps compute only the image tokens and replay a captured CUDA graph."""

    CATEGORY = "Qwen21"
    DESCRIPTION = __doc__
    RETURN_TYPES = ("LATENT",)
    RETURN_NAMES = ("latent",)
    OUTPUT_TOOLTIPS = ("Raw VAE-space latents [B, 64, H/16, W/16]; also decodable by native ComfyUI 2.1 VAEDecode.",)
    FUNCTION = "sample"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "From a Qwen21 loader."}),
                "conditioning": (CONDITIONING_TYPE, {"tooltip": "From Qwen21 Encode."}),
                "seed": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 0xFFFFFFFFFFFFFFFF,
                        "control_after_generate": True,
                        "tooltip": "Noise seed; the noise is drawn on the CPU in fp32 like ComfyUI's KSampler.",
                    },
                ),
                "steps": (
                    "INT",
                    {
                        "default": 40,
                        "min": 1,
                        "max": 200,
                        "tooltip": "Denoising steps; time grows linearly. 40 is the released default; the "
                        "turbo schedule needs the checkpoint's own (typically 8) and ignores this.",
                    },
                ),
                "true_cfg_scale": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 1.0,
                        "max": 20.0,
                        "step": 0.1,
                        "tooltip": "1.0: no guidance, one model pass per step (the released default). Above 1 the "
                        "negative prompt is used (encoded on the first such run) and every step costs two passes: "
                        "40 steps at 1024x1024 take 9.39 s instead of 4.61 s on an H200 (BENCHMARKS: DiT).",
                    },
                ),
                "width": (
                    "INT",
                    {
                        "default": 0,
                        "min": 0,
                        "max": 4096,
                        "step": 32,
                        "tooltip": "0: the size Qwen21 Encode derived (or the input latent's). Otherwise a "
                        "multiple of 32; time per step grows with pixels.",
                    },
                ),
                "height": (
                    "INT",
                    {"default": 0, "min": 0, "max": 4096, "step": 32, "tooltip": "0: derived, like width."},
                ),
                "batch_size": (
                    "INT",
                    {
                        "default": 1,
                        "min": 1,
                        "max": 16,
                        "tooltip": "Images per run, the prefix computed once for all. Each image costs about as "
                        "much as a separate run in time and activations: 40 steps at 1024x1024 take 19.6 s for 4 "
                        "images, 4.61 s for one, on an H200 (BENCHMARKS: DiT).",
                    },
                ),
                "schedule": (
                    list(SCHEDULES),
                    {
                        "default": "default",
                        "tooltip": "default: the released shifted schedule over `steps`. turbo: the checkpoint's "
                        "own few-step sigmas (error if it has none). custom: the `sigmas` below.",
                    },
                ),
                "sigmas": (
                    "STRING",
                    {
                        "default": "",
                        "tooltip": "Only with schedule=custom: comma-separated sigmas falling from <= 1.0, one per "
                        "step, e.g. '1.0, 0.75, 0.5, 0.25' (4 steps; the final 0 is implied). They get the same "
                        "resolution shift as the default schedule.",
                    },
                ),
                "denoise": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": 0.01,  # 0 would run no step at all; the schedule takes (0, 1]
                        "max": 1.0,
                        "step": 0.01,
                        "tooltip": "1.0: start from pure noise. Below 1 (needs `latent`): start from the input "
                        "latent partly noised, running only that fraction of the schedule (0.5 = half the time).",
                    },
                ),
                "prefix_cache": (
                    "BOOLEAN",
                    {
                        "default": True,
                        "tooltip": "Cache the prompt/condition K/V after step 1 (identical results). At 1024x1024 "
                        "a later step then costs 133.5 ms instead of the first step's 254.0 ms with 1 reference "
                        "image, 181.7 ms instead of 756.8 ms with 4, on an H200 (BENCHMARKS: DiT). The cache holds "
                        "0.5 MiB of VRAM per prefix token and branch in bf16 (BENCHMARKS: DiT). Off: recompute them "
                        "every step (for checking).",
                    },
                ),
                "decode_graphs": (
                    "BOOLEAN",
                    {
                        "default": True,
                        "tooltip": "Capture a whole step as a CUDA graph and replay it (bit-identical; GPU only). "
                        "It removes launch overhead: at 512x512 a step takes 26.8 ms instead of 27.4 ms eager, at "
                        "1024x1024 114.4 ms either way, on an H200 (BENCHMARKS: DiT). It also keeps the "
                        "step's buffers, so re-running the same prompt with a new seed skips the text/reference "
                        "prefill. A new size pays a capture of 103.7 ms (512x512) to 1858.1 ms (2048x2048) "
                        "(BENCHMARKS: DiT), so a shape and prompt length met for the first time is captured at "
                        "once only where launches bound the step; elsewhere that image runs eagerly and the "
                        "capture waits until the same prompt comes again (a new seed, prefix_cache on). Under "
                        "ComfyUI's default cudaMallocAsync allocator graphs need the pack's direct kernel launch "
                        "(Triton 3.6 to 3.8) and resident blocks; elsewhere the step runs eagerly and the status says "
                        "why (--disable-cuda-malloc lifts the allocator's limits). With fp8 or int8 weights a text "
                        "prompt's prefill replays from a graph too, from the second prompt of its length range (padded "
                        "to a power of two) on, with the same K/V bit for bit: 128 tokens took 6.06 ms instead of "
                        "28.34 ms eager (fp8, against bf16's eager 16.26 ms) (BENCHMARKS: Kernel launch "
                        "configurations).",
                    },
                ),
                "kv_cache": (
                    ["bf16", "fp8", "fp8_v", "int8"],
                    {
                        "default": "bf16",
                        "tooltip": "How the cached prompt/reference K/V are stored. bf16: exact. fp8 / int8: one "
                        "scale per token and head, lossy; fp8_v: only V in fp8. It matters with reference images, "
                        "whose tokens make most of the cache: with 4 at 1024x1024 on an H200 fp8 holds 4583.4 MiB "
                        "instead of 8328 MiB, a step takes 183.61 ms instead of 179.5 ms and the velocity stays "
                        "at 64.29 dB PSNR of bf16's (BENCHMARKS: Prefix K/V).",
                    },
                ),
                "kv_placement": (
                    ["auto", "gpu", "cpu"],
                    {
                        "default": "auto",
                        "tooltip": "Where the cached K/V live. auto: the GPU while it fits, else pinned CPU RAM. cpu: "
                        "CPU RAM, each layer brought over one layer ahead of use, same result: with 4 references at "
                        "1024x1024 on an H200 838.8 MiB stay on the GPU instead of 8328 MiB, and a step takes "
                        "185.31 ms instead of 179.5 ms (BENCHMARKS: Prefix K/V).",
                    },
                ),
                "compile_blocks": (
                    "BOOLEAN",
                    {
                        "default": False,
                        "tooltip": "torch.compile the blocks' elementwise math: a step at 1024x1024 takes 105.2 ms "
                        "instead of 114.4 ms, at 512x512 24.0 ms instead of 26.8 ms, on an H200, and the first run "
                        "at a new size compiles for 0.7 to 4.7 s (BENCHMARKS: DiT). Not bit-identical to the "
                        "default path: 51.6 to 53.4 dB PSNR of the velocity (BENCHMARKS: DiT).",
                    },
                ),
            },
            "optional": {
                "latent": (
                    "LATENT",
                    {"tooltip": "Start latent for denoise < 1 (ours or native ComfyUI 2.1); it also sets the size."},
                ),
                "parallel": (
                    list(PARALLEL_MODES),
                    {
                        "default": "auto",
                        "tooltip": "With a model loaded on several GPUs (the loader's `gpus`): how a run uses them. "
                        "auto: cfg at true_cfg_scale > 1 on two GPUs, else sequence. cfg: the positive and negative "
                        "branches on two GPUs at once. sequence: the image tokens split over every GPU, attention "
                        "split by heads, each GPU keeping its heads' share of the prompt/reference K/V cache; steps "
                        "run without CUDA graphs. off: the first GPU alone. Same result within rounding. With a "
                        "model on one GPU nothing changes. Tested on CPU only so far: no GPU speed figures yet.",
                    },
                ),
            },
        }

    def sample(
        self,
        model,
        conditioning,
        seed,
        steps,
        true_cfg_scale,
        width,
        height,
        batch_size,
        schedule,
        sigmas,
        denoise,
        prefix_cache,
        decode_graphs,
        compile_blocks=False,
        latent=None,
        kv_cache="bf16",
        kv_placement="auto",
        parallel="auto",
    ):
        start = None
        if latent is not None:
            start = latent["samples"]
            if start.dim() != 4 or start.shape[1] != 64:
                raise ValueError(f"latent must be Qwen-Image-2.1 latents [B, 64, H/16, W/16], got {tuple(start.shape)}")
            if start.shape[0] not in (1, batch_size):
                raise ValueError(f"latent has a batch of {start.shape[0]}; batch_size is {batch_size} (use 1 or equal)")
            height = height or start.shape[2] * LATENT_SCALE
            width = width or start.shape[3] * LATENT_SCALE
        elif denoise < 1.0:
            raise ValueError(f"denoise {denoise} < 1 needs an input `latent` to start from; connect one or set 1.0")
        custom = schedule == "custom"
        request = SampleRequest(height=height or None, width=width or None, steps=steps, true_cfg_scale=true_cfg_scale,
                                seed=seed, batch_size=batch_size, sigmas=parse_sigmas(sigmas) if custom else None,
                                schedule="default" if custom else schedule, denoise=denoise,
                                start_latents=start if denoise < 1.0 else None)  # fmt: skip
        options = SampleOptions(prefix_cache=prefix_cache, decode_graphs=decode_graphs, compile_blocks=compile_blocks,
                                kv_cache=kv_cache, kv_placement=kv_placement, parallel=parallel)  # fmt: skip

        progress = host.Progress(steps if request.sigmas is None else len(request.sigmas), "sampling step")
        projection = model.preview_projection() if host.previews_enabled() else None  # before the DiT loads

        def on_step(step: int, total: int, x0):
            progress.total = total
            progress.update(step, None if projection is None else latent_to_preview(x0, *projection))

        latents = model.sample(conditioning, request.replace(callback=on_step), options)
        stats = dict(model.pipe.last_sample_stats or {})
        status = sample_status(stats)
        if sigmas.strip() and not custom:  # a string left from a custom schedule, or typed without switching to it
            log.warning("Qwen21 Sampler: the sigmas input is used only with schedule 'custom' (it is %r); ignored",
                        schedule)  # fmt: skip
            status += f" · sigmas ignored (schedule {schedule}, not custom)"
        return {
            "ui": {"qwen21_stats": [stats], "qwen21_status": [status]},
            "result": ({"samples": latents.to(host.intermediate_device())},),
        }
