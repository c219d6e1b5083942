"""What a fresh process waits for before its first image, and what the eager step's launches cost.

    python benchmarks/bench_cold_start.py                  # H200: the cold-start matrix (child processes)
    python benchmarks/bench_cold_start.py --launch-overhead  # 512^2 eager step per format, where the CPU time goes
    python benchmarks/bench_cold_start.py --tiny --device cpu  # smoke test of the script itself

Cold start: each configuration runs in its own child process with its own Triton cache folder (TRITON_CACHE_DIR)
and CUDA driver cache (CUDA_CACHE_PATH: kernels compiled from PTX): "empty" is a fresh machine, "warm" the same
folders again (a restart). A child builds the full-size DiT (random
weights, quantised as the loader does) and the VAE on the GPU, then, as a user would: load -> (the background kernel
warm-up starts, unless --warmup off) -> a pause standing in for encoding -> the first 1024^2 DiT step (prefill and
decode, after the warm-up if on) -> a second decode -> the first VAE decode -> a second. One JSON line per child:
`cold_start` with those times, the warm-up's parts and every Triton compile it saw (count, seconds, by kernel).

Launch overhead: the 512^2 text-to-image decode step of each format, eager (synchronised wall time) with Triton's
own launch path and with the direct one (kernels/launch.py) in the same process, and the 128-token prefill, both in
--rounds interleaved rounds (the median of the rounds, ratios the median of same-round ratios); the step replayed
from a CUDA graph (GPU time alone); then the host time of one small launch on each path (`launch_cost`).
--profile adds a cProfile of eager steps (where the host time goes). Run it with
PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync for ComfyUI's default allocator (each line names the allocator).
"""

# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from _common import emit, random_dit, sync

HERE = Path(__file__).resolve().parent
ENCODE_PAUSE_S = 0.5  # stands in for the first encode, which the warm-up overlaps


def build(fmt: str, device, tiny: bool):
    from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER, TransformerConfig, VAEConfig
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS
    from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER, TINY_VAE
    from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dit = random_dit(TINY_TRANSFORMER if tiny else TransformerConfig(), device, dtype)
    if fmt != "bf16":
        dit = dit.quantized_copy(uniform_plan(FORMATS[fmt], dit.config.num_layers))
    vae = QwenImage21VAE(TINY_VAE if tiny else VAEConfig()).to(device, dtype).eval()
    pipe = Qwen21Pipeline(dit, vae, None, QWEN21_SCHEDULER)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return pipe


class CompileLog:
    """Every Triton compile in this process (Triton's post-compile hook, where this Triton has one)."""

    def __init__(self):
        self.events: list[tuple[str, float]] = []
        self.timeline: list[tuple[str, float, float, str]] = []  # (kernel, start, seconds, thread), from creation
        self.created = time.perf_counter()
        self.available = False
        try:
            import triton

            runtime = triton.knobs.runtime
        except (ImportError, AttributeError):
            return
        self.available = True
        self._started: dict = {}
        runtime.jit_cache_hook = self._before
        runtime.jit_post_compile_hook = self._after

    def _name(self, kwargs) -> str:
        fn = kwargs.get("fn")
        return str(getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", None), "__name__", "?"))

    def _before(self, **kwargs):
        self._started[kwargs.get("key")] = time.perf_counter()
        return False

    def _after(self, **kwargs):
        started = self._started.pop(kwargs.get("key"), time.perf_counter())
        name, seconds = self._name(kwargs), time.perf_counter() - started
        self.events.append((name, seconds))
        self.timeline.append((name, round(started - self.created, 2), round(seconds, 2),
                              threading.current_thread().name))  # fmt: skip
        return False

    def summary(self) -> dict:
        if not self.available:
            return {"compiles": None}
        by_kernel = Counter(name for name, _ in self.events)
        return {
            "compiles": len(self.events),
            "compile_s": round(sum(s for _, s in self.events), 2),
            "by_kernel": dict(by_kernel.most_common()),
            "timeline": sorted(self.timeline, key=lambda e: e[1]),
        }


def first_calls(args, device):
    """One child: load, warm-up, first DiT step, second decode, first and second VAE decode."""
    from bench_dit import case_inputs
    from qwen21_nodes.qwen21_core.dit.kernel_warmup import PART
    from qwen21_nodes.qwen21_core.dit.sequence import build_layout

    compiles = CompileLog()
    started = time.perf_counter()
    pipe = build(args.format, device, args.tiny)
    sync(device)
    row = dict(
        what="cold_start",
        format=args.format,
        warmup=args.warmup,
        cache=args.cache,
        autotune=os.environ.get("QWEN21_AUTOTUNE", "") == "1",
        build_s=round(time.perf_counter() - started, 1),
    )
    load_done = time.perf_counter()
    if args.warmup == "on":
        pipe.start_kernel_warmup()
    time.sleep(0 if args.tiny else ENCODE_PAUSE_S)
    res = 64 if args.tiny else 1024
    dit = pipe.transformer
    mask, embeds, cond, x, shapes, target = case_inputs(res, 0, 1, dit.config, device, dit.dtype, seed=1)
    t = torch.full((1,), 0.5, device=device, dtype=dit.dtype)
    layout = build_layout(mask, shapes, target)
    with torch.inference_mode():
        step_started = time.perf_counter()
        row["waited_for_warmup_s"] = round(pipe.kernel_warmup.wait(PART) if pipe.kernel_warmup else 0.0, 2)
        branch = dit.new_branch(layout, 1)
        dit.prefill(branch, embeds, cond)
        dit.decode(branch, x, t)
        sync(device)
        row["first_step_s"] = round(time.perf_counter() - step_started, 2)
        row["first_step_from_load_s"] = round(time.perf_counter() - load_done, 2)
        step_started = time.perf_counter()
        dit.decode(branch, x, t)
        sync(device)
        row["second_decode_ms"] = round((time.perf_counter() - step_started) * 1e3, 1)
        branch.release()
        latents = torch.randn(1, 64 if not args.tiny else pipe.vae.config.z_dim, res // 16, res // 16, device=device)
        for label in ("vae_first_s", "vae_second_s"):
            step_started = time.perf_counter()
            pipe.decode(latents)
            sync(device)
            row[label] = round(time.perf_counter() - step_started, 3)
    row["first_image_parts_s"] = round(row["first_step_s"] + row["vae_first_s"], 2)
    if pipe.kernel_warmup is not None:
        pipe.kernel_warmup.wait()
        row["warmup_parts_s"] = pipe.kernel_warmup.seconds
        row["warmup_failures"] = pipe.kernel_warmup.failures
    row.update(compiles.summary())
    emit(**row)


CHILDREN = [  # (format, warm-up, cache folder, cache state, extra environment)
    ("fp8", "off", "fp8_nowarm", "empty", {}),
    ("fp8", "on", "fp8_warm", "empty", {}),
    ("fp8", "on", "fp8_warm", "warm", {}),
    ("int8_convrot", "on", "i8r", "empty", {}),
    ("int8_convrot", "on", "i8r", "warm", {}),
    ("fp8", "off", "fp8_autotune", "empty", {"QWEN21_AUTOTUNE": "1"}),
    ("bf16", "on", "bf16", "empty", {}),
]


def orchestrate(args):
    root = Path(tempfile.mkdtemp(prefix="qwen21_cold_"))
    children = CHILDREN[:2] if args.tiny else CHILDREN
    for fmt, warmup, folder, state, extra in children:
        cache = root / folder
        if state == "empty" and cache.exists():
            raise RuntimeError(f"{cache} should be empty for this child")
        # the driver's cache of kernels compiled from PTX too: both are empty on a fresh machine
        env = dict(os.environ, TRITON_CACHE_DIR=str(cache), CUDA_CACHE_PATH=f"{cache}_cuda", **extra)
        command = [sys.executable, str(HERE / "bench_cold_start.py"), "--child", "--format", fmt, "--warmup", warmup,
                   "--cache", state, "--device", args.device] + (["--tiny"] if args.tiny else [])  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.child_timeout)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        for line in lines:
            sys.stdout.write(line + "\n")
        if done.returncode != 0 or not lines:
            emit(what="cold_start", format=fmt, warmup=warmup, cache=state, error=done.stderr[-3000:],
                 returncode=done.returncode)  # fmt: skip
        sys.stdout.flush()
        emit(what="cold_start_child", format=fmt, cache=state, process_s=round(time.perf_counter() - started, 1))


# ---- launch overhead ------------------------------------------------------------------------------------------


def launch_overhead(args, device):
    """Every format's model built first, then rounds of prefills and eager decode steps, each round timing every
    (path, format) once: a drift of the host's speed during the run (seen up to 1.8x between runs) then falls on
    every format alike, and each ratio is the median of same-round ratios."""
    from bench_dit import case_inputs, timed
    from qwen21_nodes.kernels.launch import fast_launch_active, set_fast_launch
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
    from qwen21_nodes.qwen21_core.dit.sequence import build_layout
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS
    from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    base = random_dit(TINY_TRANSFORMER if args.tiny else TransformerConfig(), device, dtype)
    res = 64 if args.tiny else 512
    mask, embeds, cond, x, shapes, target = case_inputs(res, 0, 1, base.config, device, dtype, seed=5)
    t = torch.full((1,), 0.5, device=device, dtype=dtype)
    layout = build_layout(mask, shapes, target)
    formats = ["bf16", "fp8", "int8_convrot", "int8"] if device.type == "cuda" else ["bf16", "fp8"]
    models = {fmt: base if fmt == "bf16" else base.quantized_copy(uniform_plan(FORMATS[fmt], base.config.num_layers))
              for fmt in formats}  # fmt: skip
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # Triton's own launch path, then the direct one (kernels/launch.py), every format in this one process
    paths = ["triton", "direct"] if fast_launch_active() else ["triton"]
    allocator = torch.cuda.get_allocator_backend() if device.type == "cuda" else None
    common = dict(res=res, prefix_tokens=layout.prefix_len, allocator=allocator, rounds=args.rounds)
    rows = {(fmt, path): dict(what="launch_overhead", format=fmt, launch=path, **common)
            for fmt in formats for path in paths}  # fmt: skip
    rounds: dict[tuple[str, str], list[float]] = {key: [] for key in rows}
    prefill_rounds: dict[tuple[str, str], list[float]] = {key: [] for key in rows}
    with torch.inference_mode():
        branches = {}
        for fmt in formats:
            branches[fmt] = models[fmt].new_branch(layout, 1)
            for path in paths:
                set_fast_launch(path == "direct")
                row, model, branch = rows[(fmt, path)], models[fmt], branches[fmt]
                model.prefill(branch, embeds, cond)  # the first calls of each path compile or load their variants
                model.decode(branch, x, t)
                sync(device)
                host_started = time.perf_counter()
                for _ in range(5):
                    model.decode(branch, x, t)
                row["decode_host_ms"] = round((time.perf_counter() - host_started) * 1e3 / 5, 2)  # launches queued
                sync(device)
                if args.profile:
                    row["profile_tottime_top"] = profile_steps(lambda: model.decode(branch, x, t), device)
                    row["prefill_profile_tottime_top"] = profile_steps(
                        lambda: model.prefill(branch, embeds, cond), device
                    )
        graphed = prefill_graphs_setup(models, branches, layout, mask, embeds, cond, target, rows) if (
            device.type == "cuda") else {}  # fmt: skip
        graph_rounds: dict[str, list[float]] = {fmt: [] for fmt in graphed}
        for _ in range(args.rounds):
            for path in paths:
                set_fast_launch(path == "direct")
                for fmt in formats:
                    model, branch = models[fmt], branches[fmt]
                    prefill_rounds[(fmt, path)].append(timed(lambda: model.prefill(branch, embeds, cond), device, 5))
                    rounds[(fmt, path)].append(timed(lambda: model.decode(branch, x, t), device, 10))
                    if fmt in graphed and path == paths[-1]:
                        graphs, graph_branch = graphed[fmt]
                        graph_rounds[fmt].append(timed(lambda: graphs(graph_branch, embeds, cond), device, 5))
        if args.trace:
            trace_prefills(models, branches, embeds, cond, device)
        for fmt in formats:
            branches[fmt].release()
            if device.type == "cuda":
                graphs = DecodeGraphs(models[fmt], launch_bound_share=0)
                gbranch = graphs.new_branch(layout, 1, "auto", "positive")
                models[fmt].prefill(gbranch, embeds, cond)
                graphs(gbranch, x, t)
                rows[(fmt, paths[-1])]["decode_graph_ms"] = round(timed(lambda: graphs(gbranch, x, t), device, 20), 2)
                rows[(fmt, paths[-1])]["graph_status"] = graphs.describe()
                graphs.clear()
    set_fast_launch(None)
    for (fmt, path), row in rows.items():
        prefills = prefill_rounds[(fmt, path)]
        row["prefill_ms"] = round(statistics.median(prefills), 2)
        row["prefill_rounds_ms"] = [round(v, 2) for v in prefills]
        if fmt != "bf16":
            row["prefill_vs_bf16"] = _median_ratio(prefills, prefill_rounds[("bf16", path)])
        if fmt in graph_rounds and path == paths[-1]:
            graph_times = graph_rounds[fmt]
            row["prefill_graph_ms"] = round(statistics.median(graph_times), 2)
            row["prefill_graph_vs_eager"] = _median_ratio(graph_times, prefills)
            row["prefill_graph_vs_bf16_eager"] = _median_ratio(graph_times, prefill_rounds[("bf16", path)])
        times = rounds[(fmt, path)]
        row["decode_eager_ms"] = round(statistics.median(times), 2)
        row["decode_eager_rounds_ms"] = [round(v, 2) for v in times]
        if path == "direct":
            row["eager_vs_triton_path"] = _median_ratio(times, rounds[(fmt, "triton")])
        if fmt != "bf16":
            row["eager_vs_bf16"] = _median_ratio(times, rounds[("bf16", path)])
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None
        emit(**row)
    if device.type == "cuda" and "direct" in paths:
        launch_cost(device)


def prefill_graphs_setup(models, branches, layout, mask, embeds, cond, target, rows) -> dict:
    """Each format's prefill graph (dit/prefill_graphs.py) at the benchmark's prompt length, seen and captured, with
    the capture's time and whether its K/V equal the eager prefill's bit for bit, there and at a shorter prompt padded
    into the same bucket (fields on the rows of the last launch path). -> {format: (graphs, branch)}."""
    from qwen21_nodes.qwen21_core.dit.prefill_graphs import PrefillGraphs, bucket_for
    from qwen21_nodes.qwen21_core.dit.sequence import build_layout

    def kv(branch):
        return torch.stack([torch.stack(branch.cache.prefix(i)) for i in range(branch.cache.shape.num_layers)])

    shorter = max(1, layout.prefix_len * 3 // 4)
    short_layout = build_layout(mask[:shorter], [], target)
    graphed = {}
    for fmt, model in models.items():
        graphs = PrefillGraphs(model)
        branch = model.new_branch(layout, 1)
        graphs(branch, embeds, cond)  # first sight: eager
        sync(model.device)
        started = time.perf_counter()
        graphs(branch, embeds, cond)  # captures, then replays
        sync(model.device)
        capture_ms = round((time.perf_counter() - started) * 1e3, 1)
        model.prefill(branches[fmt], embeds, cond)
        identical = bool(torch.equal(kv(branch), kv(branches[fmt])))
        short_graph, short_eager = model.new_branch(short_layout, 1), model.new_branch(short_layout, 1)
        graphs(short_graph, embeds[:shorter], cond)
        model.prefill(short_eager, embeds[:shorter], cond)
        short_identical = bool(torch.equal(kv(short_graph), kv(short_eager)))
        short_graph.release()
        short_eager.release()
        for (row_fmt, _path), row in rows.items():
            if row_fmt == fmt:
                row.update(prefill_graph_bucket=bucket_for(layout.prefix_len), prefill_graph_capture_ms=capture_ms,
                           prefill_graph_identical=identical, prefill_graph_padded_tokens=shorter,
                           prefill_graph_padded_identical=short_identical, prefill_graph=graphs.describe())  # fmt: skip
        graphed[fmt] = (graphs, branch)
    return graphed


def trace_prefills(models: dict, branches: dict, embeds, cond, device, repeats: int = 3) -> None:
    """--trace: torch.profiler over a few prefills of each format (the direct launch path where it is active): the
    host ops by own time and how much of the wall time the GPU was busy."""
    from _trace import gpu_timeline, top_host_ops, tracer

    for fmt, model in models.items():
        sync(device)
        with tracer(device) as profiler:
            for _ in range(repeats):
                with torch.profiler.record_function("qwen21 prefill"):
                    model.prefill(branches[fmt], embeds, cond)
            sync(device)
        timeline = gpu_timeline(profiler) if device.type == "cuda" else {}
        emit(what="prefill_trace", format=fmt, prefills=repeats, **timeline, top_host_ops=top_host_ops(profiler, 25))


def _median_ratio(times: list[float], against: list[float]) -> float:
    """The median of the same rounds' ratios."""
    return round(statistics.median(a / b for a, b in zip(times, against, strict=True)), 3)


def profile_steps(step, device) -> list[str]:
    """cProfile of 3 steps: the top functions by own time (Python 3.12 on counts every thread)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(3):
        step()
    sync(device)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(22)
    return [line for line in text.getvalue().splitlines() if line.strip()][-24:]


def launch_cost(device, launches: int = 3000):
    """Host time of one launch of a small kernel (a 16-row fp8 quantisation of 3072 columns), Triton's path
    against the direct one, with the GPU keeping up (each launch's work is a few microseconds)."""
    from qwen21_nodes.kernels.launch import set_fast_launch
    from qwen21_nodes.kernels.quantize_rows import quantize_rows

    x = torch.randn(16, 3072, device=device, dtype=torch.bfloat16)
    row = dict(what="launch_cost", kernel="quantize_rows fp8, 16 x 3072", launches=launches)
    for path in ("triton", "direct"):
        set_fast_launch(path == "direct")
        for _ in range(50):
            quantize_rows(x, "fp8", 0)
        sync(device)
        started = time.perf_counter()
        for _ in range(launches):
            quantize_rows(x, "fp8", 0)
        host = time.perf_counter() - started
        sync(device)
        row[f"{path}_us_per_call"] = round(host * 1e6 / launches, 2)
    row["ratio"] = round(row["direct_us_per_call"] / row["triton_us_per_call"], 3)
    set_fast_launch(None)
    emit(**row)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--launch-overhead", action="store_true")
    parser.add_argument(
        "--profile", action="store_true", help="with --launch-overhead: cProfile the eager steps and the prefills"
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="with --launch-overhead: torch.profiler over each format's prefills (prefill_trace lines)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="with --launch-overhead: timed rounds of every format")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--format", default="fp8")
    parser.add_argument("--warmup", default="on", choices=("on", "off"))
    parser.add_argument("--cache", default="empty")
    parser.add_argument("--child-timeout", type=int, default=240)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.child:
        if args.warmup == "off":
            os.environ["QWEN21_KERNEL_WARMUP"] = "0"
        first_calls(args, device)
    elif args.launch_overhead:
        launch_overhead(args, device)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
