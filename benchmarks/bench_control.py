"""Fun-Control against the plain model, in one process, on the full-size DiT and branch with random weights.

    python benchmarks/bench_control.py                                    # H200/H100: fp8, 1024^2, 40 steps
    python benchmarks/bench_control.py --sizes 1024x1024,1344x768 --steps 20
    python benchmarks/bench_control.py --tiny --device cpu --steps 3      # smoke test
    python benchmarks/bench_control.py --profile                          # + where a controlled step's time goes
    python benchmarks/bench_control.py --control-stream                   # + the control blocks on a second stream

Per size, the same prompt and noise through our sampler: plain; controlled over the whole schedule; controlled over
its first half (start 0, end 0.5); controlled with a prompt never seen before (a changed prompt: both prefixes, the
base's and the branch's, computed in its first step); and controlled through KSampler's way in (qwen21_core/velocity.py
VelocityRun, what the MODEL door runs). Each run after a warm-up run (kernels compiled, graphs captured where a path
captures): the whole run, its mean step (the first, which computes the prefixes, left out), peak VRAM and the
decode-graph outcome.

With quantised weights the branch's skips (after_proj) are first kept in bf16 (the previous path) for one controlled
run, then quantised as the loader now quantises them (`quantised_skips_speedup`: the bf16-skip step over the
quantised one; `quantised_skips_rel_rms`: the controlled latents' difference, relative RMS).

--control-stream: after those runs, the controlled run again with QWEN21_CONTROL_STREAM on (the control blocks run
ahead on a second CUDA stream): `control_stream_speedup` (the one-stream step over it), `control_stream_identical`
(its latents against the one-stream run's, bit for bit) and its peak.

Ratios printed (issue 52's targets): controlled step / plain step (<= 1.5: the branch is half the base's blocks);
the changed-prompt controlled run / its steps at the controlled step's cost (<= 1.10); half-range run / (half plain +
half controlled steps at their own cost: steps outside the range cost the plain step); KSampler's controlled step /
our sampler's (<= 1.05).

Output: one JSON line per size ("control_vs_plain"). With --profile, per size and path (plain, controlled) one
"control_profile" line: eager steps (no CUDA graphs, so every kernel is seen) under torch's profiler, the step's kernel
time by kind (fp8 GEMM, bf16 GEMM: the branch's after_proj in an fp8 model, attention, Triton, other) and its top
kernels.
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
    random_weights,
    sync,
)

GIB = 2**30
CONTROL_BLOCKS = 16


def build(args, device):
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.dit.control import SKIP, FunControlNet, control_plan
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    config = TransformerConfig(num_layers=2, num_attention_heads=2, context_in_dim=64) if args.tiny else (
        TransformerConfig())  # fmt: skip
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    transformer = random_dit(config, device, dtype)
    blocks = 1 if args.tiny else CONTROL_BLOCKS
    with torch.device("meta"):
        net = FunControlNet(config, blocks).to(dtype)
    net = random_weights(net, device, seed=1)
    if args.weights != "bf16":
        transformer.quantize_linears(uniform_plan(FORMATS[args.weights], config.num_layers))
        net.quantize_linears(control_plan(FORMATS[args.weights], blocks, keep=[SKIP]))  # skips: see measure
    return pipeline_without_encoders(transformer, device), config, net


def sampler_run(pipe, cond, noise, steps, control):
    from qwen21_nodes.qwen21_core.request import SampleRequest

    h, w = noise.shape[-2:]
    times, last = [], [None]

    def callback(step, total, x0):
        sync(pipe.device)
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    request = SampleRequest(height=h * 16, width=w * 16, steps=steps, noise=noise, callback=callback, control=control)
    sync(pipe.device)
    last[0] = time.perf_counter()
    sampler_run.latents = pipe.sample_request(cond, request)
    return times, dict(pipe.last_sample_stats)


def velocity_run(pipe, cond, noise, steps, control):
    """ComfyUI's euler at cfg 1 through a VelocityRun, every call controlled (what the door does in range)."""
    from qwen21_nodes.qwen21_core.velocity import Part

    h, w = noise.shape[-2:]
    context = pipe.control_context(control, (h, w))
    sigmas = torch.linspace(1.0, 0.0, steps + 1, device=pipe.device)
    run = pipe.velocity_run(cond, h * 16, w * 16, noise.shape[0], control=control)
    x = noise.to(pipe.device) * sigmas[0]
    times = []
    try:
        for i in range(steps):
            sync(pipe.device)
            started = time.perf_counter()
            v = run.velocity(x, sigmas[i].expand(x.shape[0]), [Part(cond, "positive", x.shape[0])], control, context)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
            sync(pipe.device)
            times.append(time.perf_counter() - started)
    finally:
        run.close()
    return times, dict(pipe.last_sample_stats)


def changed_prompt_run(pipe, cond, noise, steps, control):
    """sampler_run with a prompt of the same length never sampled before (a new content hash and new rows)."""
    changed_prompt_run.count += 1
    prompt = cond.positive
    embeds = prompt.embeds + 0.01 * changed_prompt_run.count
    fresh = type(cond)(type(prompt)(embeds, prompt.image_pad_mask), content_hash=f"bench:new{changed_prompt_run.count}")
    return sampler_run(pipe, fresh, noise, steps, control)


changed_prompt_run.count = 0


def kernel_kind(name: str) -> str:
    """A CUDA kernel's kind, from its name (cuBLAS/CUTLASS names carry their input types)."""
    lower = name.lower()
    if "flash" in lower or "fmha" in lower or "attention" in lower:
        return "attention"
    if "e4m3" in lower or "f8" in lower or "fp8" in lower:
        return "gemm_fp8"
    if "gemm" in lower or "nvjet" in lower or "xmma" in lower or "cutlass" in lower:
        return "gemm_other"
    if lower.startswith("_") or "triton" in lower:  # our Triton kernels are named after their Python functions
        return "triton"
    return "other"


def profile_steps(pipe, cond, noise, control, name: str, size: str, steps: int = 7, top: int = 14) -> dict:
    """Eager steps (decode graphs off) under the profiler: the run's first step (the prefixes) and one more left out
    (the profiler's own warm-up), the rest recorded."""
    from qwen21_nodes.qwen21_core.options import SampleOptions
    from qwen21_nodes.qwen21_core.request import SampleRequest
    from torch.profiler import ProfilerActivity, profile, schedule

    h, w = noise.shape[-2:]
    eager = SampleOptions(decode_graphs=False)
    recorded = steps - 2
    cuda = pipe.device.type == "cuda"  # on the CPU (the smoke test) the operators' own time stands in
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    spent = "device_time_total" if cuda else "self_cpu_time_total"
    with profile(activities=[activity], schedule=schedule(wait=1, warmup=1, active=recorded)) as prof:

        def callback(step, total, x0):
            sync(pipe.device)
            prof.step()

        request = SampleRequest(height=h * 16, width=w * 16, steps=steps, noise=noise, callback=callback,
                                control=control)  # fmt: skip
        pipe.sample_request(cond, request, eager)  # kernels compiled and graphs off already: one run suffices
    events = [e for e in prof.key_averages() if getattr(e, spent) > 0]
    per_step = 1 / (recorded * 1e3)  # microseconds over the recorded steps -> ms per step
    kinds: dict[str, float] = {}
    for event in events:
        kind = kernel_kind(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + getattr(event, spent) * per_step
    ranked = sorted(events, key=lambda e: -getattr(e, spent))[:top]
    return dict(what="control_profile", size=size, path=name, recorded_steps=recorded,
                step_kernel_ms=round(sum(kinds.values()), 2),
                kinds_ms={kind: round(ms, 2) for kind, ms in sorted(kinds.items())},
                top=[[e.key[:70], round(getattr(e, spent) * per_step, 3), round(e.count / recorded, 1)]
                     for e in ranked])  # fmt: skip


def measure(pipe, config, net, args, size: str):
    from qwen21_nodes.qwen21_core.control import Control
    from qwen21_nodes.qwen21_core.dit.control import control_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    width, height = (int(side) for side in size.split("x"))
    h, w = height // 16, width // 16
    device = pipe.device
    cond = prompt_conditioning(config, args.prompt_tokens, size)
    noise = torch.randn(1, config.in_channels, h, w, generator=torch.Generator().manual_seed(1))
    context = torch.randn(h * w, net.control_channels, generator=torch.Generator().manual_seed(2))
    dummy = torch.zeros(1, 16, 16, 3)
    full = Control(net, 1.0, image=dummy)
    half = Control(net, 1.0, 0.0, 0.5, image=dummy)
    pipe.control_context = lambda control, latent_size: context  # a random context: no VAE in this benchmark
    runs = {"plain": (sampler_run, None), "controlled": (sampler_run, full), "half": (sampler_run, half),
            "changed_prompt_controlled": (changed_prompt_run, full),
            "ksampler_controlled": (velocity_run, full)}  # fmt: skip
    row = dict(what="control_vs_plain", size=size, steps=args.steps, weights=args.weights,
               control_blocks=len(net.control_blocks),
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")  # fmt: skip

    def timed(name, run, control):
        for _warm in range(args.warmups):
            run(pipe, cond, noise, args.steps, control)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        times, stats = run(pipe, cond, noise, args.steps, control)
        sync(device)
        row[f"{name}_s"] = round(time.perf_counter() - started, 3)
        row[f"{name}_step_ms"] = round(1000 * sum(times[1:]) / max(1, len(times) - 1), 2)
        row[f"{name}_decode_graph"] = str(stats.get("decode_graph"))[:80]
        row[f"{name}_control"] = stats.get("control")
        if device.type == "cuda":
            row[f"{name}_peak_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)

    skips_kept = None
    if args.weights != "bf16":  # the previous path first: quantised blocks, bf16 skips; then the skips quantised too
        timed("controlled_bf16_skips", sampler_run, full)
        skips_kept = sampler_run.latents.float()
        net.quantize_linears(control_plan(FORMATS[args.weights], len(net.control_blocks)))
    one_stream = None
    for name, (run, control) in runs.items():
        timed(name, run, control)
        if name == "controlled":
            one_stream = sampler_run.latents
        if name == "controlled" and skips_kept is not None:
            diff = sampler_run.latents.float() - skips_kept
            row["quantised_skips_rel_rms"] = round((diff.pow(2).mean() / skips_kept.pow(2).mean()).sqrt().item(), 5)
    if args.control_stream:  # the same controlled run with the control blocks on a second stream
        from qwen21_nodes.qwen21_core import settings

        before = settings.replace(control_stream=True)
        try:
            timed("controlled_stream", sampler_run, full)
        finally:
            settings.use(before)
        row["control_stream_identical"] = bool(torch.equal(sampler_run.latents, one_stream))
        row["control_stream_speedup"] = round(row["controlled_step_ms"] / row["controlled_stream_step_ms"], 3)
    if skips_kept is not None:
        row["quantised_skips_speedup"] = round(row["controlled_bf16_skips_step_ms"] / row["controlled_step_ms"], 3)
    row["controlled_step_ratio"] = round(row["controlled_step_ms"] / row["plain_step_ms"], 3)
    expected_half = (row["plain_s"] + row["controlled_s"]) / 2
    steps_s = args.steps * row["controlled_step_ms"] / 1000
    row["changed_prompt_ratio"] = round(row["changed_prompt_controlled_s"] / steps_s, 3)
    row["half_run_ratio"] = round(row["half_s"] / expected_half, 3)
    row["ksampler_ratio"] = round(row["ksampler_controlled_step_ms"] / row["controlled_step_ms"], 3)
    emit(**row)
    if args.profile:
        for name, control in (("plain", None), ("controlled", full)):
            emit(**profile_steps(pipe, cond, noise, control, name, size))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_arguments(parser, sizes="1024x1024", steps=40)
    parser.add_argument("--profile", action="store_true", help="eager steps' kernels, plain and controlled")
    parser.add_argument("--control-stream", action="store_true",
                        help="also the controlled run with the control blocks on a second CUDA stream")  # fmt: skip
    args = parser.parse_args()
    device = torch.device(args.device)
    with torch.inference_mode():
        pipe, config, net = build(args, device)
        for size in args.sizes.split(","):
            measure(pipe, config, net, args, size)


if __name__ == "__main__":
    main()
