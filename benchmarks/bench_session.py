"""The session: what a user waits for, from the first image in a fresh process to the last, through the node classes.

    python benchmarks/bench_session.py                          # H200: the sessions in SESSIONS (child processes)
    python benchmarks/bench_session.py --only fp8:none:empty,fp8:none:warm
    python benchmarks/bench_session.py --turbo                  # fp8 + a LoRA, 8 steps, changed prompts
    python benchmarks/bench_session.py --small 3                # fp8, changed 512^2 prompts (launch-bound steps)
    python benchmarks/bench_session.py --child fp8:none:warm --limit 3 --settle   # a restart, the warm-up done first
    python benchmarks/bench_session.py --tiny --device cpu      # smoke test of the script itself

A session is one process (a child of this script) with full-size random weights built in memory as bench_e2e.py
builds them (the DiT, the Qwen3-VL-8B text encoder, the VAE; quantised as the loader does), the loader's defaults
(offload_text_encoder "auto"), and the example workflows run by the in-process runner with the same node classes
ComfyUI loads, 40 steps. In order: the first image (1024^2 text-to-image), changed prompts at 1024^2, 1344x768,
768x1344 and 1536^2, an edit with 1 reference and one with 4, back to seen shapes, a seed-only rerun, a LoRA (rank 64
on every block Linear) switched on and its strength changed, and a mixed tail of changed prompts. Every prompt but the
rerun is new text, so the encoder runs each time. As in ComfyUI, a node whose inputs did not change is not run again:
each session runs its prompts with one runner OutputCache, so the loader runs once, the LoRA node when the LoRA or
its strength changes, and the rerun reuses the encoder's output; each prompt's line lists the nodes it took from the
cache (`cached`, by class) and has no `*_s` for them.

Kernel cache: "empty" is a new TRITON_CACHE_DIR and CUDA_CACHE_PATH (the driver's cache of kernels compiled from
PTX; both are empty on a fresh machine), "warm" the ones an earlier session filled (a restart). A cap (24 / 16 / 12
GiB) is `set_per_process_memory_fraction` plus the same budget given to the memory manager, as bench_e2e.py does;
capped sessions of one precision share a process (sequential, state reset between them) to save the build, which
`shared_process` says.

Output, one JSON line each: `session_prompt` per prompt, `session_summary` per session (see the issue's fields:
first_image_s, steady_image_s, changed_prompt_ratio, new_shape_extra_s, prompts, errors; plus load_s, the
allocated-memory bound and the warm-up's timings).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import logging
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import emit, sync  # noqa: E402

HERE = Path(__file__).resolve().parent
GIB = 2**30
SAVE_NODES = ("Qwen21SaveImage", "SaveImage")  # the pack's PNG writer, ComfyUI's (the runner's stand-in)
# the field of a session_prompt line each node's seconds go to (bench_comfyui_session.py's lines too)
NODE_PHASES = {"Qwen21Encode": "encode_s", "Qwen21Sampler": "sample_s", "Qwen21VAEDecode": "decode_s",
               "Qwen21LoraLoader": "lora_s", "Qwen21ModelLoader": "loader_s", "KSampler": "sample_s",
               "VAEDecode": "decode_s", "LoraLoaderModelOnly": "lora_s",
               **dict.fromkeys(SAVE_NODES, "save_s")}  # fmt: skip
BASE_PROMPT = "A cozy reading corner by a rain-streaked window at dusk, warm lamp light, a ginger cat asleep"
DETAILS = ["on a knitted blanket", "beside a steaming teapot", "under a paper lantern", "next to a globe",
           "among potted ferns", "in soft morning fog", "with snow outside", "with a chess board", "by candlelight",
           "with a violin case", "in autumn colours", "with neon reflections"]  # fmt: skip
# (label, workflow, width, height, references): the shapes a session meets
SHAPES = {
    "t2i_1024": ("text_to_image.json", 1024, 1024, 0),
    "t2i_1344x768": ("text_to_image.json", 1344, 768, 0),
    "t2i_768x1344": ("text_to_image.json", 768, 1344, 0),
    "t2i_1536": ("text_to_image.json", 1536, 1536, 0),
    "t2i_512": ("text_to_image.json", 512, 512, 0),  # --small only
    "edit_1ref": ("edit_1_reference.json", 1024, 1024, 1),
    "edit_4ref": ("edit_4_references.json", 1024, 1024, 4),
}
# --tiny: the tiny model at small sizes of the same aspects (multiples of 32)
TINY_SIZES = {"t2i_1024": (128, 128), "t2i_1344x768": (192, 96), "t2i_768x1344": (96, 192), "t2i_1536": (160, 160),
              "edit_1ref": (128, 128), "edit_4ref": (128, 128), "t2i_512": (64, 64)}  # fmt: skip
TAIL = ["t2i_1024", "t2i_1344x768", "edit_1ref", "t2i_768x1344", "t2i_1024", "edit_4ref", "t2i_1536", "edit_1ref",
        "t2i_1024", "t2i_1344x768"]  # fmt: skip
CAPPED_TAIL = 4
# (precision, cap GiB or None, kernel cache) of each session, most needed first; sessions in one group share a
# process (the first of a group with an "empty" cache gets a new cache folder)
SESSIONS = [
    [("fp8", None, "empty")],
    [("fp8", None, "warm"), ("fp8", 24, "warm"), ("fp8", 16, "warm"), ("fp8", 12, "warm")],
    [("int8_convrot", None, "empty"), ("int8_convrot", 24, "warm"), ("int8_convrot", 12, "warm")],
    [("bf16", None, "warm"), ("bf16", 24, "warm")],
]


def plan(tail: int) -> list[dict]:
    """The session's prompts: shape, whether the text changed, LoRA strength (None: no LoRA). The unchanged one
    follows a prompt of its shape: the output cache keeps only the latest prompt's nodes, as ComfyUI's does."""
    steps = [("t2i_1024", True, None), ("t2i_1024", True, None), ("t2i_1024", True, None),
             ("t2i_1344x768", True, None), ("t2i_768x1344", True, None), ("t2i_1536", True, None),
             ("edit_1ref", True, None), ("edit_4ref", True, None), ("t2i_1024", True, None),
             ("t2i_1024", False, None), ("edit_1ref", True, None), ("t2i_1024", True, 1.0), ("t2i_1024", True, 0.6),
             ("t2i_1024", True, None)]  # fmt: skip
    steps += [(TAIL[i % len(TAIL)], True, None) for i in range(tail)]
    return [{"label": label, "changed": changed, "lora": lora} for label, changed, lora in steps]


# ---- one session ------------------------------------------------------------------------------------------


def session_prompt(spec: dict, index: int, args, lora_name: str | None, text_index: int) -> dict:
    from qwen21_nodes.runner.cli import WORKFLOWS_DIR
    from qwen21_nodes.runner.graph import load_prompt

    workflow, width, height, _refs = SHAPES[spec["label"]]
    if args.tiny:
        width, height = TINY_SIZES[spec["label"]]
    prompt = load_prompt(json.loads((WORKFLOWS_DIR / "api" / workflow).read_text()))
    text = f"{BASE_PROMPT} {DETAILS[text_index % len(DETAILS)]}, take {text_index}"
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "Qwen21Encode":
            inputs["prompt"] = text
            inputs["output_resolution"] = max(width, height)
        if node["class_type"] == "Qwen21Sampler":
            inputs.update(seed=1000 + index, steps=args.steps, width=width, height=height)
        if node["class_type"] in SAVE_NODES and args.save_node:
            node["class_type"] = args.save_node
    if spec["lora"] is not None:
        model_users = [n for n in prompt.values() if n["inputs"].get("model") == ["1", 0]]
        prompt["90"] = {"class_type": "Qwen21LoraLoader",
                        "inputs": {"model": ["1", 0], "lora_name": lora_name, "strength": spec["lora"]}}  # fmt: skip
        for node in model_users:
            node["inputs"]["model"] = ["90", 0]
    return prompt


def run_session(handle, precision, cap, cache, args, device, output_dir, lora_name, specs: list[dict],
                fresh: bool) -> None:  # fmt: skip
    from _trace import tracer as torch_tracer
    from bench_e2e import cap_memory, classes_with, reset
    from qwen21_nodes.nodes import memory_adapter
    from qwen21_nodes.runner.graph import OutputCache, execute

    if not fresh:
        reset(handle, device)
    cap_memory(device, cap)
    load_started = time.perf_counter()
    handle = place_as_loaded(handle, cap, device)
    load_s = round(time.perf_counter() - load_started, 2)
    settled_s = settle(handle) if args.settle and fresh else None
    classes = classes_with(handle, output_dir, device)
    if args.trace:
        classes = labelled_nodes(classes)
    node_cache = OutputCache()  # one per session, as a ComfyUI server keeps one
    traced_at = [int(i) for i in args.trace.split(",") if i]
    seen, rows, profiles = {}, [], []
    kind = dict(precision=precision, cap_gib=cap, kernel_cache=cache)
    for index, spec in enumerate(specs):
        # the unchanged prompt: the previous prompt's text with a new seed
        prompt = session_prompt(spec, index, args, lora_name, index if spec["changed"] else index - 1)
        shape = spec["label"] + (":lora" if spec["lora"] is not None else "")
        row = dict(what="session_prompt", **kind, i=index, label=shape, first_of_shape=shape not in seen,
                   changed_prompt=spec["changed"], lora_strength=spec["lora"])  # fmt: skip
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        profiled = (
            (args.profile == "steady" and index >= 2)
            or (args.profile == "new-shapes" and index > 0 and row["first_of_shape"])
            or (args.profile == "first" and index == 0)
        )
        profiler = cProfile.Profile() if profiled else None
        tracer = torch_tracer(device, args.trace_stack) if index in traced_at else contextlib.nullcontext()
        started = time.perf_counter()
        try:
            if profiler is not None:
                profiler.enable()
            try:
                with tracer:
                    result = execute(prompt, classes, node_cache)
                    sync(device)
            finally:
                if profiler is not None:
                    profiler.disable()
                    profiles.append(profiler)
        except Exception as error:  # noqa: BLE001 - a failure is a result here; the session goes on
            root = error
            while root.__cause__ is not None:
                root = root.__cause__
            row["error"] = f"{type(root).__name__}: {str(root)[:400]}"
            traceback.print_exception(error, file=sys.stderr)
            emit(**row)
            rows.append(row)
            seen[shape] = True
            continue
        row["total_s"] = round(time.perf_counter() - started, 3)
        for node_id, seconds in result.seconds.items():
            name = NODE_PHASES.get(prompt[node_id]["class_type"])
            if name:
                row[name] = round(row.get(name, 0) + seconds, 3)
        row["cached"] = sorted(prompt[node_id]["class_type"] for node_id in result.cached)
        if device.type == "cuda":
            row["allocated_after_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 2)
            row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
        stats = handle.pipe.last_sample_stats
        row["plan"] = stats.get("plan")
        row["decode_graph"] = stats.get("decode_graph")
        row["prefill_graph"] = stats.get("prefill_graph")
        row["branch_setup_s"] = stats.get("branch_setup_s")  # new K/V caches: pinned host RAM is slow to get
        row["text_encoder_on_gpu"] = handle.text_encoder.device_bytes() > 0
        seen[shape] = True
        emit(**row)
        rows.append(row)
        if not isinstance(tracer, contextlib.nullcontext):
            emit(**traced(tracer, kind, row, args, first=index == min(traced_at)))
    warmup = handle.pipe.kernel_warmup
    out = summary(rows, kind, load_s, warmup)
    if settled_s is not None:
        out["settled_s"] = settled_s
    references = handle.pipe.references
    out["reference_cache"] = {"hits": references.hits, "misses": references.misses}
    # host-placed K/V caches served from a kept pinned buffer (this process so far) and what is kept now
    from qwen21_nodes.qwen21_core.memory.pinned_buffers import HOST_KV_BUFFERS

    out["host_kv_buffers"] = {"reused": HOST_KV_BUFFERS.reused, "kept_gib": round(HOST_KV_BUFFERS.kept_bytes / GIB, 2)}
    if device.type == "cuda":
        out["free_query_ms"] = free_query_cost(device)
    emit(**out)
    if profiles:
        emit(**profile_summary(profiles, kind, args))
    memory_adapter.LOCAL.loaded.clear()


def settle(handle) -> float:
    """--settle: wait, before the first prompt, for the kernel warm-up and the load's CUDA priming to finish, as if
    the prompt came long after the model was loaded; -> the seconds waited. Against a run without it, what the warm-up
    running beside a first prompt costs that prompt."""
    from qwen21_nodes.qwen21_core.startup.priming import prime_torch_kernels

    started = time.perf_counter()
    priming = prime_torch_kernels(handle.pipe.device)
    if priming is not None:
        priming.join()
    if handle.pipe.kernel_warmup is not None:
        handle.pipe.kernel_warmup.wait()
    return round(time.perf_counter() - started, 3)


def summary(rows: list[dict], kind: dict, load_s: float, warmup) -> dict:
    ok = [r for r in rows if "error" not in r]
    steady = [r for r in ok[1:] if r["label"] == "t2i_1024" and r["changed_prompt"]]
    shapes: dict[str, list[dict]] = {}
    for row in ok:
        shapes.setdefault(row["label"], []).append(row)
    # a new shape's extra wait: its first image against its later ones (not the session's first image, and not the
    # LoRA prompts, whose first includes the merge)
    extras = {label: round(rs[0]["total_s"] - statistics.median(r["total_s"] for r in rs[1:]), 3)
              for label, rs in shapes.items()
              if rs[0]["first_of_shape"] and len(rs) > 1 and rs[0] is not ok[0] and ":lora" not in label}  # fmt: skip
    allocated = [r["allocated_after_gib"] for r in ok if "allocated_after_gib" in r]
    out = dict(what="session_summary", **kind, load_s=load_s,
               first_image_s=ok[0]["total_s"] if ok and ok[0]["i"] == 0 else None,
               steady_image_s=round(statistics.median(r["total_s"] for r in steady), 3) if steady else None,
               changed_prompt_ratio=round(statistics.median(
                   r["total_s"] / (r["sample_s"] + r["decode_s"]) for r in steady), 3) if steady else None,
               steady_encode_s=round(statistics.median(r["encode_s"] for r in steady), 3) if steady else None,
               new_shape_extra_s=max(extras.values()) if extras else None, new_shape_extras=extras,
               prompts=len(rows), errors=len(rows) - len(ok),
               allocated_after_max_gib=max(allocated) if allocated else None,
               allocated_after_last_gib=allocated[-1] if allocated else None)  # fmt: skip
    if out["first_image_s"] and out["steady_image_s"]:
        out["first_over_steady"] = round(out["first_image_s"] / out["steady_image_s"], 2)
    if warmup is not None:
        out["warmup_parts_s"] = warmup.seconds
        out["warmup_failures"] = warmup.failures
    return out


def labelled_nodes(classes: dict) -> dict:
    """The node classes with each run inside a "node <class>" profiler range, so a trace says which node the host
    was in while the GPU waited (benchmarks/_trace.py)."""
    labelled = {}
    for name, cls in classes.items():
        function = getattr(cls, cls.FUNCTION)

        def run(self, *args, _function=function, _label=f"node {name}", **kwargs):
            with torch.profiler.record_function(_label):
                return _function(self, *args, **kwargs)

        labelled[name] = type(cls.__name__, (cls,), {cls.FUNCTION: run})
    return labelled


def traced(tracer, kind: dict, row: dict, args, first: bool) -> dict:
    """--trace: a session_trace line for one prompt (GPU busy and idle, the gaps by what the host was in, the top
    kernels and host ops); the first traced prompt's Chrome trace goes to --log-dir."""
    from _trace import gpu_timeline, top_host_ops

    if first and args.log_dir:
        tracer.export_chrome_trace(str(Path(args.log_dir, f"session_trace_{kind['precision']}_{row['i']}.json")))
    return dict(what="session_trace", **kind, i=row["i"], label=row["label"], total_s=row.get("total_s"),
                **gpu_timeline(tracer), top_host_ops=top_host_ops(tracer))  # fmt: skip


def free_query_cost(device, repeats: int = 20) -> dict:
    """The free-memory query (memory/planner.py device_free_bytes) with the session's graphs alive, in this process:
    as it runs (an allocator snapshot kept until the allocator does something) and with a snapshot every time (as
    before)."""
    from qwen21_nodes.qwen21_core.memory import planner

    def per_call(fresh: bool) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            if fresh:
                planner._pool_snapshots.clear()
            planner.device_free_bytes(device)
        return round((time.perf_counter() - started) / repeats * 1e3, 3)

    fresh, kept = per_call(True), per_call(False)
    return dict(kept=kept, fresh=fresh, fresh_over_kept=round(fresh / kept, 1) if kept else None,
                graph_pools=len(planner.graph_pool_idle_bytes(device)))  # fmt: skip


def profile_summary(profiles: list, kind: dict, args, top: int = 45) -> dict:
    """--profile: the host's time over the profiled prompts, by function (cumulative and own seconds per prompt), the
    largest first; the whole table goes to --log-dir as a pstats file."""
    stats = pstats.Stats(profiles[0])
    for more in profiles[1:]:
        stats.add(more)
    if args.log_dir:
        stats.dump_stats(str(Path(args.log_dir, f"session_{kind['precision']}_{kind['cap_gib']}.pstats")))
    rows = []
    for (path, line, name), (_calls, ncalls, own, cumulative, _callers) in stats.stats.items():
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}:{name}" if path != "~" else name
        rows.append((cumulative, own, ncalls, where))
    per = len(profiles)
    by_cumulative = sorted(rows, reverse=True)[:top]
    by_own = sorted(rows, key=lambda r: r[1], reverse=True)[:top]
    table = [[round(c / per, 4), round(o / per, 4), round(n / per, 1), w] for c, o, n, w in by_cumulative]
    own = [[round(o / per, 4), round(n / per, 1), w] for _c, o, n, w in by_own]
    snapshot = {}
    if torch.cuda.is_available():  # what one allocator snapshot costs now (the planner's free-memory query takes one)
        from qwen21_nodes.qwen21_core.memory import planner

        started = time.perf_counter()
        for _ in range(5):
            planner._pool_snapshots.clear()  # a snapshot each time
            pools = planner.graph_pool_idle_bytes(torch.device("cuda"))
        snapshot = dict(snapshot_ms=round((time.perf_counter() - started) / 5 * 1e3, 2), graph_pools=len(pools),
                        segments=len(torch.cuda.memory_snapshot()))  # fmt: skip
    return dict(
        what="session_profile",
        **kind,
        prompts=per,
        **snapshot,
        per_prompt_cumulative_own_calls=table,
        per_prompt_own_calls=own,
    )


# ---- placing the in-memory model as a loader would ------------------------------------------------------------


def place_as_loaded(handle, cap, device):
    """As a loader leaves the weights: uncapped, everything on the GPU (from_pretrained loads to the device);
    capped, in the weights' pinned host copies, for the memory manager to place on first use. The kernel warm-up
    starts here, as from_pretrained starts it."""
    pipe = handle.pipe
    if device.type == "cuda":
        if cap is None:
            pipe.transformer.place(device)
            pipe.text_encoder.place(device)
            pipe.vae.to(device)
        else:
            pipe.transformer.place("cpu")
            pipe.text_encoder.place("cpu")
            pipe.vae.to("cpu")
        sync(device)
    pipe.start_kernel_warmup()
    return handle


def build(precision: str, args, device, dtype):
    """(DiT, text encoder model, processor, VAE) of one precision, built and quantised where they run (the GPU): one
    precision per process, so nothing is kept twice and nothing crosses to the CPU (bench_e2e.py builds several
    precisions from one float copy instead)."""
    from bench_e2e import build_parts
    from qwen21_nodes.qwen21_core.checkpoints.loading import TEXT_ENCODER_QUANTIZES_ACTIVATIONS
    from qwen21_nodes.qwen21_core.config import TransformerConfig, VAEConfig
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.quant.linear import quantize_linears_
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS
    from qwen21_nodes.qwen21_core.text.encoder import decoder_linear_names
    from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE

    if args.tiny:
        dit, full, processor, vae = build_parts(args, device, dtype)
    else:
        from _common import random_dit
        from bench_text_encoder import build_full_size

        full, processor = build_full_size(device, dtype)
        dit = random_dit(TransformerConfig(), device, dtype)
        torch.manual_seed(0)
        vae = QwenImage21VAE(VAEConfig()).to(device, dtype).eval()
    text = full.model
    if precision != "bf16":
        fmt = FORMATS[precision]
        dit = dit.quantized_copy(uniform_plan(fmt, dit.config.num_layers))  # the float blocks are dropped with `dit`
        quantize_linears_(text, decoder_linear_names(text), fmt, TEXT_ENCODER_QUANTIZES_ACTIVATIONS)  # as the loader
    del full
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dit, text, processor, vae


def child(args, specs: list[dict]) -> None:
    from bench_e2e import handle_for
    from bench_lora import write_lora
    from qwen21_nodes.nodes import host
    from qwen21_nodes.qwen21_core.startup import priming

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("qwen21_nodes").setLevel(logging.INFO)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sessions = [tuple(part.split(":")) for part in args.child.split(",")]
    # the kernel cache as it really is: "empty" when this process found nothing compiled (a fresh machine)
    cache_dir = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    found = "warm" if cache_dir.is_dir() and any(cache_dir.iterdir()) else "empty"
    sessions = [(p, cap, found if index == 0 else "warm") for index, (p, cap, _said) in enumerate(sessions)]
    precision = sessions[0][0]
    if any(s[0] != precision for s in sessions):
        raise SystemExit("a child runs sessions of one precision")
    started = time.perf_counter()
    priming.prime(device)  # as a loader's from_pretrained does first: it runs while the model is built (read)
    parts = build(precision, args, device, dtype)
    models = Path(tempfile.mkdtemp(prefix="qwen21_session_models_"))
    (models / "loras").mkdir()
    lora_name = "session_lora.safetensors"
    write_lora(models / "loras" / lora_name, parts[0], 64, seed=3)
    host.set_models_dir(models)
    handle = handle_for(parts, device, dtype, offload_text_encoder="auto")  # the loader's default
    emit(what="session_setup", precision=precision, build_s=round(time.perf_counter() - started, 1),
         device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", torch=torch.__version__,
         triton_cache=os.environ.get("TRITON_CACHE_DIR"), shared_process=len(sessions) > 1,
         steps=args.steps)  # fmt: skip
    output_dir = tempfile.mkdtemp(prefix="qwen21_session_out_")
    for index, (_precision, cap, cache) in enumerate(sessions):
        cap = None if cap in ("none", "") else int(cap)
        # capped sessions: the same prompts with a shorter tail (their targets are on the changed-prompt images)
        count = len(specs) - args.tail + min(args.tail, args.capped_tail) if cap is not None else len(specs)
        count = len(specs) if args.limit else count  # --limit already cut the plan
        run_session(handle, precision, cap, cache, args, device, output_dir, lora_name, specs[:count],
                    fresh=index == 0)  # fmt: skip


# ---- the orchestrator -----------------------------------------------------------------------------------------


def orchestrate(args) -> int:
    """Each group of SESSIONS in its own child process; a group whose first session's kernel cache is "empty" gets a
    new Triton cache folder, the others the folder the last child filled."""
    groups = SESSIONS if not args.tiny else [[("fp8", None, "empty"), ("fp8", 24, "warm")]]
    wanted = [part for part in args.only.split(",") if part]
    root = Path(tempfile.mkdtemp(prefix="qwen21_session_cache_"))
    cache, failures = None, 0
    for number, group in enumerate(groups):
        chosen = [s for s in group if not wanted or _label(s) in wanted]
        if not chosen:
            continue
        if chosen[0][2] == "empty" or cache is None:
            cache = root / f"cache_{number}"
        command = [sys.executable, str(HERE / "bench_session.py"), "--child", ",".join(_label(s) for s in chosen),
                   "--device", args.device, "--steps", str(args.steps), "--tail", str(args.tail),
                   "--capped-tail", str(args.capped_tail), "--limit", str(args.limit)]  # fmt: skip
        command += ["--profile", args.profile, "--log-dir", args.log_dir] if args.profile else []
        command += ["--trace", args.trace, "--log-dir", args.log_dir] if args.trace else []
        command += ["--trace-stack"] if args.trace_stack else []
        command += ["--tiny"] if args.tiny else []
        command += ["--save-node", args.save_node] if args.save_node else []
        command += ["--settle"] if args.settle else []
        returncode = stream_child(
            command,
            # the driver's cache of kernels compiled from PTX too: both are empty on a fresh machine
            dict(os.environ, TRITON_CACHE_DIR=str(cache), CUDA_CACHE_PATH=f"{cache}_cuda"),
            args.child_timeout,
            Path(args.log_dir or tempfile.gettempdir(), f"session_{number}_{chosen[0][0]}.log"),
        )
        if returncode != 0:
            failures += 1
            emit(what="session_child", sessions=[_label(s) for s in chosen], returncode=returncode)
    return failures


def stream_child(command: list[str], env: dict, timeout: float, log_path: Path) -> int:
    """Run a child, passing its JSON lines through as they come (a child stopped at its time limit keeps what it
    printed) and its log to `log_path`; -> its return code (-9 when stopped)."""
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log_file, text=True)
        deadline = time.monotonic() + timeout
        killer = threading.Timer(timeout, process.kill)
        killer.start()
        try:
            for line in process.stdout:
                if line.startswith("{"):
                    sys.stdout.write(line)
                    sys.stdout.flush()
            returncode = process.wait(max(1.0, deadline - time.monotonic()))
        finally:
            killer.cancel()
    return returncode


def _label(session) -> str:
    precision, cap, cache = session
    return f"{precision}:{'none' if cap is None else cap}:{cache}"


def turbo_plan(count: int) -> list[dict]:
    """fp8 + a LoRA at 8 steps (the turbo LoRA workflow's setting), changed prompts at 1024^2: the aim is a changed-
    prompt image in under a second. A random rank-64 LoRA stands in for the turbo LoRA (its cost is its merge)."""
    return [{"label": "t2i_1024", "changed": True, "lora": 1.0} for _ in range(count)]


def small_plan(count: int) -> list[dict]:
    """Changed prompts at 512^2, 40 steps: a step the host's launches bound, so the first image in a process should
    already replay a decode graph, also while the kernel warm-up runs (dit/decode_graphs.py)."""
    return [{"label": "t2i_512", "changed": True, "lora": None} for _ in range(count)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--only", default="", help="sessions precision:cap:cache, e.g. fp8:none:empty,fp8:24:warm")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tail", type=int, default=20, help="the mixed tail's length")
    parser.add_argument("--capped-tail", type=int, default=CAPPED_TAIL,
                        help="a capped session's tail (at most --tail); 26 makes a 40-prompt session")  # fmt: skip
    parser.add_argument("--turbo", action="store_true", help="fp8 + LoRA, 8 steps, changed 1024^2 prompts")
    parser.add_argument("--small", type=int, default=0, metavar="N",
                        help="fp8, N changed 512^2 prompts in this process: does the first replay?")  # fmt: skip
    parser.add_argument("--limit", type=int, default=0,
                        help="run only the first N prompts of a session (its first image, the next ones)")  # fmt: skip
    parser.add_argument("--save-node", choices=SAVE_NODES, default="",
                        help="save every image with this node instead of the workflow's: SaveImage is ComfyUI's "
                        "(the runner's stand-in: PIL, one core), Qwen21SaveImage the pack's")  # fmt: skip
    parser.add_argument("--settle", action="store_true",
                        help="wait for the kernel warm-up and the CUDA priming before the first prompt (settled_s in "
                        "the summary): what they cost a first prompt beside it, against a run without")  # fmt: skip
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-timeout", type=int, default=560)
    parser.add_argument("--log-dir", default="")
    parser.add_argument(
        "--profile",
        nargs="?",
        const="steady",
        choices=["steady", "new-shapes", "first"],
        help="the host's time by function (cProfile; a session_profile line, and a pstats file in --log-dir): over "
        "the prompts from the third on (steady), over the first prompt of each new shape after the first, or over "
        "the session's first prompt (first). cProfile counts the main thread only up to Python 3.11; from 3.12 on (the "
        "H200's) every thread, the warm-up's too",
    )
    parser.add_argument("--trace", nargs="?", const="2,3", default="", metavar="I,J",
                        help="torch.profiler over the prompts numbered I, J (from 0; default 2,3): a session_trace "
                        "line each (GPU busy and idle, what the host was in while the GPU waited); the earliest one's "
                        "Chrome trace in --log-dir")  # fmt: skip
    parser.add_argument(
        "--trace-stack",
        action="store_true",
        help="with --trace: Python frames in the Chrome trace too (what the host ran between ops)",
    )
    args = parser.parse_args()
    if args.tiny:
        args.steps = min(args.steps, 2)
        args.tail = min(args.tail, 2)
    if (args.child or args.turbo or args.small) and torch.device(args.device).type == "cuda":
        # a session's process starts as ComfyUI does, CUDA first and then the custom nodes (`plan` below imports them;
        # their import starts nothing: the child primes as a load does, qwen21_core/startup/priming.py)
        torch.cuda.init()
    if args.turbo or args.small:  # one session in this process, on whatever kernel cache it finds
        args.steps = min(args.steps, 8) if args.turbo else args.steps
        args.child = args.child or "fp8:none:warm"
        child(args, turbo_plan(8 + args.tail // 4) if args.turbo else small_plan(args.small))
        return 0
    if args.child:
        child(args, plan(args.tail)[: args.limit or None])
        return 0
    return 1 if orchestrate(args) else 0


if __name__ == "__main__":
    sys.exit(main())
