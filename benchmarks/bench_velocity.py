"""KSampler's way into our DiT against our own sampler, in one process, on the full-size DiT with random weights.

    python benchmarks/bench_velocity.py                                   # H200: 1024^2, 1344x768, 768x1344
    python benchmarks/bench_velocity.py --sizes 1344x768 --profile        # and each path's top CUDA kernels
    python benchmarks/bench_velocity.py --tiny --device cpu --steps 3     # smoke test

ComfyUI's samplers ask the MODEL for one velocity per call (qwen21_core/velocity.py VelocityRun, what the door
runs); our sampler runs its own loop (Sampler.sample_request). Both compute the same steps on the same weights (fp8
by default, as the session's files); this prints, per size, each path's whole run and its mean step (the first
step, which computes the prefix, left out), their ratio and peak VRAM, the decode-graph outcome of each path, and
the largest difference of the results (the euler loops are the same math).

Output: one JSON line per size ("velocity_vs_sampler"), and with --profile one per path ("velocity_profile") with
the top CUDA kernels by total time.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import (  # noqa: E402
    add_sampling_arguments,
    emit,
    pipeline_without_encoders,
    prompt_conditioning,
    random_dit,
    sync,
)

GIB = 2**30


def build(args, device):
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    config = TransformerConfig(num_layers=2, num_attention_heads=2, context_in_dim=64) if args.tiny else (
        TransformerConfig())  # fmt: skip
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    transformer = random_dit(config, device, dtype)
    if args.weights != "bf16":
        transformer.quantize_linears(uniform_plan(FORMATS[args.weights], config.num_layers))
    return pipeline_without_encoders(transformer, device), config


def velocity_loop(pipe, cond, noise, sigmas):
    """ComfyUI's euler with cfg 1 through a VelocityRun: one model call per step, latents on the device."""
    from qwen21_nodes.qwen21_core.velocity import Part

    h, w = noise.shape[-2:]
    run = pipe.velocity_run(cond, h * 16, w * 16, noise.shape[0])
    x = noise.to(pipe.device) * sigmas[0]
    times = []
    try:
        for i in range(len(sigmas) - 1):
            sync(pipe.device)
            started = time.perf_counter()
            v = run.velocity(x, sigmas[i].expand(x.shape[0]), [Part(cond, "positive", x.shape[0])])
            x = x + (sigmas[i + 1] - sigmas[i]) * v
            sync(pipe.device)
            times.append(time.perf_counter() - started)
    finally:
        run.close()
    return x, times, dict(pipe.last_sample_stats)


def sampler_loop(pipe, cond, noise, sigmas):
    from qwen21_nodes.qwen21_core.request import SampleRequest

    h, w = noise.shape[-2:]
    times, last = [], [None]

    def callback(step, total, x0):
        sync(pipe.device)
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    request = SampleRequest(height=h * 16, width=w * 16, steps=len(sigmas) - 1, noise=noise, callback=callback,
                            sigmas=[float(s) for s in sigmas[:-1]])  # fmt: skip
    sync(pipe.device)
    last[0] = time.perf_counter()
    out = pipe.sample_request(cond, request)
    return out, times, dict(pipe.last_sample_stats)


def measure(pipe, config, args, size: str, profile: bool):
    width, height = (int(side) for side in size.split("x"))
    h, w = height // 16, width // 16
    device = pipe.device
    cond = prompt_conditioning(config, args.prompt_tokens, size)
    noise = torch.randn(1, config.in_channels, h, w, generator=torch.Generator().manual_seed(1))
    sigmas = torch.linspace(1.0, 0.0, args.steps + 1, device=device)
    row = dict(what="velocity_vs_sampler", size=size, steps=args.steps, weights=args.weights,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")  # fmt: skip
    results = {}
    for name, loop in (("velocity", velocity_loop), ("sampler", sampler_loop)):
        for _warm in range(args.warmups):  # compiles kernels, captures graphs where a path would
            loop(pipe, cond, noise, sigmas)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        out, times, stats = loop(pipe, cond, noise, sigmas)
        sync(device)
        row[f"{name}_s"] = round(time.perf_counter() - started, 3)
        row[f"{name}_step_ms"] = round(1000 * sum(times[1:]) / max(1, len(times) - 1), 2)
        row[f"{name}_decode_graph"] = str(stats.get("decode_graph"))[:80]
        if device.type == "cuda":
            row[f"{name}_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
        results[name] = out.float().cpu()
        if profile:
            emit(**profiled(pipe, loop, cond, noise, sigmas, name, size))
    row["step_ratio"] = round(row["velocity_step_ms"] / row["sampler_step_ms"], 3)
    # the sampler returns raw latents (mean 0, std 1 here: the same numbers)
    row["max_abs_difference"] = (results["velocity"] - results["sampler"]).abs().max().item()
    emit(**row)


def profiled(pipe, loop, cond, noise, sigmas, name, size, top=12):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loop(pipe, cond, noise, sigmas)
    events = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)[:top]
    return dict(what="velocity_profile", path=name, size=size,
                kernels=[{"name": e.key[:90], "ms": round(e.device_time_total / 1000, 2), "calls": e.count}
                         for e in events])  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_arguments(parser, sizes="1024x1024,1344x768,768x1344", steps=20)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    with torch.inference_mode():
        pipe, config = build(args, device)
        for size in args.sizes.split(","):
            measure(pipe, config, args, size, args.profile)


if __name__ == "__main__":
    main()
