"""Several GPUs (issue 24): one GPU against N in the same script, on full-size random weights (_common.random_dit; the
workers build the same weights on their own GPU). Prints one JSON line per measurement.

    python benchmarks/bench_multigpu.py                                       # x2 H200: every part (over 10 min)
    python benchmarks/bench_multigpu.py --parts sampling --precisions bf16    # one part at a time fits 10 minutes:
    python benchmarks/bench_multigpu.py --parts sampling --precisions fp8
    python benchmarks/bench_multigpu.py --parts kv,encoder,recovery
    python benchmarks/bench_multigpu.py --tiny --device cpu --world-size 2    # smoke test: 2 CPU processes, gloo

Parts:
- sampling (`multigpu_sampling`): per precision (bf16, fp8 weights), size (1024^2, 2048^2) and true_cfg_scale (1, 4):
  40 steps on one GPU (CUDA graphs on) and on all of them (cfg 1: sequence parallel; cfg 4: CFG parallel and
  sequence parallel), each run prefilling its prefix (128 text tokens). The first step, the median later step, the
  40-step time, the ratio to one GPU, peak VRAM of every GPU and the PSNR of the latents against one GPU's.
- kv (`multigpu_kv_cache`): 4 reference images at 1024^2 (the first precision, cfg 1): each GPU's prefix K/V cache
  against the single-GPU cache, and the step times.
- encoder (`multigpu_text_encoder`): the 8B text encoder resident on GPU 1 against on GPU 0 offloaded after each
  prompt (the one-GPU default): a changed prompt (encode + 40 steps at 1024^2) against a seed-only rerun.
- recovery (`multigpu_recovery`): a fault injected into worker rank 1 mid-step (an error, then a process exit): the
  error the user gets, how long it took, and the next run's PSNR against the one-GPU result.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import emit, random_dit, sync, worker_dit  # noqa: E402
from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding  # noqa: E402
from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER, TransformerConfig  # noqa: E402
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs  # noqa: E402
from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan  # noqa: E402
from qwen21_nodes.qwen21_core.options import SampleOptions  # noqa: E402
from qwen21_nodes.qwen21_core.parallel.pool import ParallelError, WorkerPool  # noqa: E402
from qwen21_nodes.qwen21_core.parallel.recipes import FunctionRecipe  # noqa: E402
from qwen21_nodes.qwen21_core.quant.weights import FORMATS  # noqa: E402
from qwen21_nodes.qwen21_core.sampler import Sampler, make_noise  # noqa: E402
from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER  # noqa: E402

GIB = 2**30
TEXT_TOKENS = 128
PARTS = ("sampling", "kv", "encoder", "recovery")


def psnr(a, b) -> float:
    a, b = a.float(), b.float()
    mse = (a - b).pow(2).mean().item()
    peak = b.abs().max().item()
    return float("inf") if mse == 0 else round(10 * math.log10(peak * peak / mse), 2)


def conditioning(config: TransformerConfig, res: int, refs: int, dtype, seed: int) -> Conditioning:
    """128 random text tokens (half, then each reference with 4 text tokens after it, then the rest) and a 128-token
    negative prompt, as bench_dit lays them out; references res x res. No content hash: every run prefills."""
    g = torch.Generator().manual_seed(seed)
    lat = res // 16
    parts = [torch.zeros(TEXT_TOKENS // 2, dtype=torch.bool)]
    for _ in range(refs):
        parts += [torch.ones(lat * lat // 4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)]
    parts.append(torch.zeros(TEXT_TOKENS - TEXT_TOKENS // 2, dtype=torch.bool))
    mask = torch.cat(parts)
    positive = PromptEmbedding(torch.randn(mask.shape[0], config.context_in_dim, generator=g).to(dtype), mask)
    negative_mask = torch.cat([parts[0], *parts[1:-1], parts[-1]])
    negative = PromptEmbedding(torch.randn(negative_mask.shape[0], config.context_in_dim, generator=g).to(dtype),
                               negative_mask)  # fmt: skip
    images = tuple(torch.randn(config.in_channels, lat, lat, generator=g) for _ in range(refs))
    return Conditioning(positive, negative, condition_latents=images, width=res, height=res)


def devices_for(args) -> list[torch.device]:
    if args.device == "cpu":
        return [torch.device("cpu")] * args.world_size
    return [torch.device("cuda", i) for i in range(args.world_size)]


def peak_bytes(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def fresh(device, graphs: DecodeGraphs | None, pool: WorkerPool | None) -> None:
    """Nothing kept from the previous run (graphs, caches), the peak counter reset."""
    if graphs is not None:
        graphs.clear()
    if pool is not None:
        pool.release()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def sample(dit, graphs, pool, mode, cond, res, cfg, steps, seed=0, options=None):
    """One run; returns (latents, stats dict, first step s, median later step s, total s)."""
    device = dit.device
    sampler = Sampler(dit, QWEN21_SCHEDULER, torch.zeros(dit.config.in_channels), torch.ones(dit.config.in_channels),
                      options=options or SampleOptions(parallel=mode, kv_placement="gpu"), decode_runner=graphs,
                      workers=pool)  # fmt: skip
    stamps = []

    def on_step(_step, _total, _x0):
        sync(device)
        stamps.append(time.perf_counter())

    noise = make_noise(seed, (1, dit.config.in_channels, res // 16, res // 16))
    sync(device)
    start = time.perf_counter()
    latents = sampler.sample([cond], height=res, width=res, steps=steps, true_cfg_scale=cfg, noise=noise,
                             callback=on_step)  # fmt: skip
    sync(device)
    total = time.perf_counter() - start
    later = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return latents, sampler.stats, stamps[0] - start, statistics.median(later) if later else None, total


def measured(dit, graphs, pool, mode, cond, res, cfg, steps) -> dict:
    """A 2-step warm-up (graph capture, first collectives), then the timed run, with every GPU's peak."""
    device = dit.device
    fresh(device, graphs, pool)
    sample(dit, graphs, pool, mode, cond, res, cfg, min(2, steps))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    latents, stats, first, step, total = sample(dit, graphs, pool, mode, cond, res, cfg, steps)
    peaks = [peak_bytes(device)] + [rank.get("peak_vram_mib", 0) * 2**20 or None for rank in stats.ranks]
    return dict(latents=latents.float().cpu(), first_step_ms=round(first * 1e3, 1),
                step_ms=None if step is None else round(step * 1e3, 2), total_s=round(total, 3),
                peak_vram_gib=[None if p is None else round(p / GIB, 2) for p in peaks], stats=stats)  # fmt: skip


def build_dit(config, device, precision):
    dit = random_dit(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    if precision != "bf16":
        dit.quantize_linears(uniform_plan(FORMATS[precision], config.num_layers))
    return dit


def start_pool(args, config, devices, precision) -> WorkerPool:
    dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    weights = None if precision == "bf16" else precision
    recipe = FunctionRecipe(worker_dit, (config, dtype), {"weights": weights})
    started = time.perf_counter()
    pool = WorkerPool.start(devices[1:], recipe, devices[0], timeout_s=args.timeout)
    emit(what="multigpu_workers", precision=precision, ranks=pool.world, backend=pool.backend,
         start_s=round(time.perf_counter() - started, 1), worker=pool.workers[0].info)  # fmt: skip
    return pool


# ---- parts ----------------------------------------------------------------------------------------------------


def part_sampling(args, config, devices, precision, dit, graphs, pool):
    dtype = dit.dtype
    for res in args.sizes:
        for cfg in args.cfgs:
            cond = conditioning(config, res, 0, dtype, seed=res)
            one = measured(dit, graphs, None, "off", cond, res, cfg, args.steps)
            modes = ["sequence"] + (["cfg"] if cfg > 1 and pool.world == 2 else [])
            for mode in modes:
                many = measured(dit, graphs, pool, mode, cond, res, cfg, args.steps)
                emit(what="multigpu_sampling", precision=precision, dtype=str(dtype), res=res, true_cfg_scale=cfg,
                     mode=mode, gpus=pool.world, steps=args.steps, one_gpu_first_step_ms=one["first_step_ms"],
                     one_gpu_step_ms=one["step_ms"], one_gpu_total_s=one["total_s"],
                     first_step_ms=many["first_step_ms"], step_ms=many["step_ms"], total_s=many["total_s"],
                     total_ratio=round(many["total_s"] / one["total_s"], 3),
                     step_ratio=None if not one["step_ms"] else round(many["step_ms"] / one["step_ms"], 3),
                     one_gpu_peak_vram_gib=one["peak_vram_gib"][0], peak_vram_gib=many["peak_vram_gib"],
                     psnr_vs_one_gpu=psnr(many["latents"], one["latents"]),
                     max_abs_vs_one_gpu=round((many["latents"] - one["latents"]).abs().max().item(), 5),
                     one_gpu_decode_graph=one["stats"].decode_graph, decode_graph=many["stats"].decode_graph,
                     worker_decode_graph=[r["decode_graph"] for r in many["stats"].ranks])  # fmt: skip


def part_kv(args, config, devices, dit, graphs, pool):
    res, refs = args.kv_size, 4
    cond = conditioning(config, res, refs, dit.dtype, seed=7)
    one = measured(dit, graphs, None, "off", cond, res, 1.0, args.kv_steps)
    many = measured(dit, graphs, pool, "sequence", cond, res, 1.0, args.kv_steps)
    single = one["stats"].cache_bytes
    per_gpu = [many["stats"].cache_bytes] + [r["prefix_cache_bytes"] for r in many["stats"].ranks]
    emit(what="multigpu_kv_cache", quantization=dit.quantization, res=res, references=refs, gpus=pool.world,
         prefix_tokens=one["stats"].prefix_tokens,
         one_gpu_cache_mib=round(single / 2**20, 1), per_gpu_cache_mib=[round(b / 2**20, 1) for b in per_gpu],
         per_gpu_cache_ratio=round(max(per_gpu) / single, 3), one_gpu_step_ms=one["step_ms"], step_ms=many["step_ms"],
         one_gpu_first_step_ms=one["first_step_ms"], first_step_ms=many["first_step_ms"],
         one_gpu_peak_vram_gib=one["peak_vram_gib"][0], peak_vram_gib=many["peak_vram_gib"],
         psnr_vs_one_gpu=psnr(many["latents"], one["latents"]))  # fmt: skip


def part_recovery(args, config, devices, dit, graphs, pool):
    res = args.sizes[0]
    cond = conditioning(config, res, 0, dit.dtype, seed=11)
    fresh(dit.device, graphs, pool)
    one = sample(dit, graphs, None, "off", cond, res, 1.0, args.recovery_steps)[0]
    for kind in args.faults.split(","):
        pool.inject_fault(1, "in_block", kind)
        started = time.perf_counter()
        try:
            sample(dit, graphs, pool, "sequence", cond, res, 1.0, args.recovery_steps)
            error = None
        except ParallelError as failure:
            error = str(failure)
        failed_after = time.perf_counter() - started
        started = time.perf_counter()
        again = sample(dit, graphs, pool, "sequence", cond, res, 1.0, args.recovery_steps)[0]
        emit(what="multigpu_recovery", fault=kind, res=res, error=error, error_after_s=round(failed_after, 2),
             next_run_s=round(time.perf_counter() - started, 2), next_run_psnr_vs_one_gpu=psnr(again, one))  # fmt: skip


def encode_and_sample(pipe, prompt: str, res: int, steps: int, seed: int):
    """(conditioning, encode seconds, encode + sample seconds) of a new prompt."""
    sync(pipe.device)
    started = time.perf_counter()
    cond = pipe.encode(prompt, output_resolution=res)
    sync(pipe.text_encoder_device)
    encoded = time.perf_counter()
    pipe.sample(cond, height=res, width=res, steps=steps, seed=seed, options=SampleOptions(parallel="off"))
    sync(pipe.device)
    return cond, encoded - started, time.perf_counter() - started


def part_encoder(args, config, devices):
    """The text encoder on GPU 1 (resident) against GPU 0 with offload after encoding (the one-GPU default)."""
    from bench_text_encoder import build_full_size, prompt_of
    from qwen21_nodes.qwen21_core.config import VAEConfig
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline
    from qwen21_nodes.qwen21_core.text.encoder import Qwen21TextEncoder
    from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE

    main, other = devices[0], devices[1]
    dtype = torch.bfloat16 if main.type == "cuda" else torch.float32
    if args.tiny:
        from qwen21_nodes.qwen21_core.text.tiny import build_tiny_text_encoder
        from qwen21_nodes.qwen21_core.tiny import TINY_VAE  # 64 latent channels, like TINY_TRANSFORMER

        full, processor = build_tiny_text_encoder(hidden_size=config.context_in_dim)
        full = full.to(other, dtype)
        vae_config = TINY_VAE
    else:
        full, processor = build_full_size(other, dtype)
        vae_config = VAEConfig()
    torch.manual_seed(0)
    vae = QwenImage21VAE(vae_config).to(main, dtype).eval()
    dit = build_dit(config, main, "bf16")
    encoder = Qwen21TextEncoder(full.model, processor)
    res = 64 if args.tiny else 1024
    prompts = [prompt_of(encoder, TEXT_TOKENS) + f" {word}" for word in ("one", "two", "three")]
    for placement in ("resident on GPU 1", "offloaded from GPU 0"):
        device = other if placement.startswith("resident") else main
        encoder.to(device)
        pipe = Qwen21Pipeline(dit, vae, encoder, QWEN21_SCHEDULER, text_encoder_offload=device == main)
        cond, _, _ = encode_and_sample(pipe, prompts[0], res, args.steps, 0)  # warm-up: graphs captured
        sync(main)
        started = time.perf_counter()
        pipe.sample(cond, height=res, width=res, steps=args.steps, seed=1, options=SampleOptions(parallel="off"))
        sync(main)
        seed_rerun = time.perf_counter() - started
        _, encode_s, changed = encode_and_sample(pipe, prompts[1], res, args.steps, 2)
        emit(what="multigpu_text_encoder", encoder=placement, res=res, steps=args.steps,
             seed_rerun_s=round(seed_rerun, 3), changed_prompt_s=round(changed, 3), encode_s=round(encode_s, 3),
             changed_minus_seed_rerun_s=round(changed - seed_rerun, 3),
             changed_minus_encode_over_seed_rerun=round((changed - encode_s) / seed_rerun, 3))  # fmt: skip
        pipe.release()
    encoder.to("cpu")
    del dit, vae, full, encoder
    gc.collect()
    if main.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world-size", type=int, default=max(2, torch.cuda.device_count()),
                        help="ranks (GPUs; on --device cpu: CPU processes)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="tiny random model (smoke test)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated among {PARTS}")
    parser.add_argument("--precisions", default="bf16,fp8")
    parser.add_argument("--sizes", default=None, help="comma-separated (default 1024,2048; tiny 64)")
    parser.add_argument("--cfgs", default="1,4")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default 40; tiny 3)")
    parser.add_argument("--kv-size", type=int, default=None, help="reference and output size of the kv part")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective and step timeout (s)")
    parser.add_argument("--faults", default="error,exit", help="what the recovery part injects (error, oom, exit)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose among {PARTS}")
    args.sizes = [int(s) for s in (args.sizes or ("64" if args.tiny else "1024,2048")).split(",")]
    args.cfgs = [float(c) for c in args.cfgs.split(",")]
    args.steps = args.steps or (3 if args.tiny else 40)
    args.kv_size = args.kv_size or (64 if args.tiny else 1024)
    args.kv_steps = args.recovery_steps = min(args.steps, 10)
    devices = devices_for(args)
    if args.device != "cpu" and torch.cuda.device_count() < args.world_size:
        parser.error(f"--world-size {args.world_size} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    config = TINY_TRANSFORMER if args.tiny else TransformerConfig()
    torch.set_grad_enabled(False)
    emit(what="multigpu_setup", devices=[str(d) for d in devices], parts=parts, steps=args.steps, sizes=args.sizes,
         cfgs=args.cfgs, precisions=args.precisions.split(","), torch=torch.__version__,
         gpu=torch.cuda.get_device_name(0) if args.device != "cpu" else "cpu")  # fmt: skip
    dit_parts = [p for p in parts if p in ("sampling", "kv", "recovery")]
    precisions = args.precisions.split(",")
    for precision in precisions if dit_parts else []:
        wanted = [p for p in dit_parts if p == "sampling" or precision == precisions[0]]  # kv, recovery: the first
        if not wanted:
            continue
        dit = build_dit(config, devices[0], precision)
        graphs = DecodeGraphs(dit, launch_bound_share=0) if devices[0].type == "cuda" else None
        pool = start_pool(args, config, devices, precision)
        try:
            if "sampling" in wanted:
                part_sampling(args, config, devices, precision, dit, graphs, pool)
            if "kv" in wanted:
                part_kv(args, config, devices, dit, graphs, pool)
            if "recovery" in wanted:
                part_recovery(args, config, devices, dit, graphs, pool)
        finally:
            pool.shutdown()
            if graphs is not None:
                graphs.clear()
            del dit, graphs
            gc.collect()
            if devices[0].type == "cuda":
                torch.cuda.empty_cache()
    if "encoder" in parts:
        part_encoder(args, config, devices)


if __name__ == "__main__":
    main()
