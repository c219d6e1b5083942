"""QK-RMSNorm + RoPE (+ K/V cache write): torch reference vs our fused Triton kernel vs comfy-kitchen.

Part 1, the op: for each sequence length, B x S tokens of 32 heads x 128 in bf16, as the transformer calls
it (q, k, v read from the strided [B, S, 3, H, D] view of one QKV GEMM output; k and v written into a
slice of a preallocated K/V cache), timed eagerly (host launch overhead included, as in an eager decode
step) and inside a captured CUDA graph (launch overhead gone). comfy-kitchen's `rms_rope` (the fused op
ComfyUI itself uses) normalises and rotates q and k only, from contiguous q and k as ComfyUI's model holds
them, so it is compared with our q/k-only call. Then the token crossovers the gate should use.
Part 2, the model: one full-size decode step (random weights, bf16) at 512^2 and 1024^2 with the fusion
forced on and off (through the gate's environment variables, which the transformer reads), eager and as
a CUDA-graph replay.

    python benchmarks/bench_qk_norm_rope.py                       # cuda, full size
    python benchmarks/bench_qk_norm_rope.py --sweep               # + launch-shape sweep of our kernel
    python benchmarks/bench_qk_norm_rope.py --tiny --device cpu   # seconds; our kernel runs only
                                                                  # with TRITON_INTERPRET=1

JSON lines: "env"; one "op" line per (tokens, mode) with the time of each variant in microseconds and
ratios; one "op_accuracy" line per length (ours: max ulp at the pair magnitude and the fraction of
elements that differ from the reference; comfy-kitchen: the same); "crossover" lines; with --sweep,
"sweep" lines; "decode_step" lines.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import time

import torch
from _common import emit, sync
from qwen21_nodes.kernels import _triton
from qwen21_nodes.kernels import qk_norm_rope as qnr

EPS = 1e-6
NEVER = 10**12  # a token threshold no call reaches: the reference path
CACHE_PREFIX = 128  # k_out / v_out start this far into the K/V cache, as a decode step's target slice does
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------


def time_eager(fn, device, iters, repeats):
    """Median seconds per call of `iters` back-to-back calls (host overhead shows when it dominates)."""
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        sync(device)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def time_graph(fn, device, iters, repeats):
    """Median seconds per call of `iters` calls captured into one CUDA graph and replayed."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.sync()
        samples.append(start.elapsed_time(end) / 1e3 / iters)
    del graph
    return statistics.median(samples)


# ---------------------------------------------------------------------------------------------------------
# Part 1: the op
# ---------------------------------------------------------------------------------------------------------


def make_op_inputs(batch, seq, heads, head_dim, dtype, device):
    gen = torch.Generator(device="cpu").manual_seed(seq)
    qkv = torch.randn(batch, seq, 3 * heads * head_dim, generator=gen).to(device, dtype)
    qkv = qkv.view(batch, seq, 3, heads, head_dim)
    q_weight = (0.5 + torch.rand(head_dim, generator=gen)).to(device, dtype)
    k_weight = (0.5 + torch.rand(head_dim, generator=gen)).to(device, dtype)
    angles = torch.rand(seq, head_dim // 2, generator=gen) * 100
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    k_cache, v_cache = (
        torch.empty(batch, CACHE_PREFIX + seq, heads, head_dim, dtype=dtype, device=device) for _ in range(2)
    )
    return qkv, q_weight, k_weight, cos, sin, k_cache[:, CACHE_PREFIX:], v_cache[:, CACHE_PREFIX:]


def comfy_kitchen_variants(device):
    """{label: (backend name or None, callable)} for comfy-kitchen's rms_rope, or a reason it is absent."""
    try:
        import comfy_kitchen
        from comfy_kitchen.registry import registry

        try:
            version = importlib.metadata.version("comfy-kitchen")
        except importlib.metadata.PackageNotFoundError:  # unpacked without its dist-info (as carried to the GPU)
            version = getattr(comfy_kitchen, "__version__", "unknown")
    except Exception as error:  # noqa: BLE001 - any import failure means "not comparable here"
        return {}, f"unavailable ({type(error).__name__}: {error})"
    backends = [name for name in ("cuda", "triton", "eager") if registry.is_available(name)]
    if device.type != "cuda":
        backends = [name for name in backends if name == "eager"]

    def call_with(backend):
        def call(q, k, freqs, q_weight, k_weight):
            with registry.use_backend(backend):
                return comfy_kitchen.rms_rope(q, k, freqs, q_weight, k_weight, EPS)

        return call

    return {f"comfy_kitchen[{name}]": call_with(name) for name in backends}, f"comfy-kitchen {version}"


def comfy_kitchen_freqs(cos, sin):
    """cos/sin [S, D/2] -> comfy-kitchen's rotation matrices [1, S, 1, D/2, 2, 2] ([[c, -s], [s, c]])."""
    rows = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    return rows[None, :, None]


def ulps_at_pair_magnitude(actual, expected):
    expected32 = expected.float()
    magnitude = expected32.unflatten(-1, (-1, 2)).norm(dim=-1, keepdim=True)
    magnitude = magnitude.expand(*magnitude.shape[:-1], 2).flatten(-2)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude.clamp_min(1e-30)))) * torch.finfo(expected.dtype).eps
    return (actual.float() - expected32).abs() / ulp


def accuracy(got, want):
    return dict(
        max_ulp=round(float(ulps_at_pair_magnitude(got, want).max()), 2),
        frac_differs=float((got != want).float().mean()),
    )


def op_variants(inputs, kitchen, ours_runs):
    """{label: zero-argument call} for one set of op inputs."""
    qkv, q_w, k_w, cos, sin, k_out, v_out = inputs
    variants = {
        "torch": lambda: qnr.qk_norm_rope(qkv, q_w, k_w, cos, sin, EPS, k_out, v_out, min_tokens=NEVER),
        "torch_qk_only": lambda: qnr.qk_norm_rope(qkv, q_w, k_w, cos, sin, EPS, min_tokens=NEVER),
    }
    if ours_runs:
        variants["ours"] = lambda: qnr.qk_norm_rope(qkv, q_w, k_w, cos, sin, EPS, k_out, v_out, min_tokens=0)
        variants["ours_qk_only"] = lambda: qnr.qk_norm_rope(qkv, q_w, k_w, cos, sin, EPS, min_tokens=0)
    if kitchen:
        # ComfyUI's model holds q and k as contiguous tensors; the copies are made here, outside the timing.
        q, k, freqs = qkv[:, :, 0].contiguous(), qkv[:, :, 1].contiguous(), comfy_kitchen_freqs(cos, sin)
        for label, call in kitchen.items():
            variants[label] = _bind(call, q, k, freqs, q_w, k_w)
    return variants


def _bind(fn, *args):
    return lambda: fn(*args)


def _failure(error):
    return f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"


def bench_op(args, device, dtype, kitchen):
    rows = []
    ours_runs = _triton.triton_runs_on(device)
    modes = ["eager"] + (["graph"] if device.type == "cuda" and not args.no_graph else [])
    for seq in args.seqs:
        tokens = args.batch * seq
        variants = op_variants(
            make_op_inputs(args.batch, seq, args.heads, args.head_dim, dtype, device), kitchen, ours_runs
        )
        # Accuracy against the reference, once per length (cloned: later calls overwrite k_out).
        q_ref, k_ref = (t.clone() for t in variants["torch"]()[:2])
        checks = {}
        for label, fn in variants.items():
            if label.startswith("torch"):
                continue
            try:
                q, k = fn()[:2]
                checks[label] = dict(q=accuracy(q, q_ref), k=accuracy(k, k_ref))
            except Exception as error:  # noqa: BLE001 - a variant that cannot run this shape says why
                checks[label] = _failure(error)
        emit(bench="op_accuracy", tokens=tokens, **checks)
        broken = {label for label, check in checks.items() if isinstance(check, str)}

        for mode in modes:
            timer = time_eager if mode == "eager" else time_graph
            times = {}
            for label, fn in variants.items():
                if label in broken:
                    continue
                try:
                    times[label] = timer(fn, device, args.iters, args.repeats)
                except Exception as error:  # noqa: BLE001 - e.g. a third-party op that cannot be captured
                    times[label] = _failure(error)
            row = dict(bench="op", tokens=tokens, heads=args.heads, head_dim=args.head_dim, mode=mode)
            row.update({f"{label}_us": _us(value) for label, value in times.items()})
            row.update(_ratios(times))
            emit(**row)
            rows.append(dict(tokens=tokens, mode=mode, times=times))
    return rows


def _us(value):
    return round(value * 1e6, 2) if isinstance(value, float) else value


def _ratios(times):
    """torch / ours (with the cache write), and fastest comfy-kitchen / ours (q and k only)."""
    ratios = {}
    if isinstance(times.get("ours"), float):
        ratios["speedup_vs_torch"] = round(times["torch"] / times["ours"], 3)
    if isinstance(times.get("ours_qk_only"), float):
        ratios["speedup_qk_only_vs_torch"] = round(times["torch_qk_only"] / times["ours_qk_only"], 3)
        kitchen = [v for k, v in times.items() if k.startswith("comfy_kitchen") and isinstance(v, float)]
        if kitchen:
            ratios["speedup_qk_only_vs_comfy_kitchen"] = round(min(kitchen) / times["ours_qk_only"], 3)
    return ratios


def report_crossovers(rows):
    """Per mode: the smallest measured token count from which ours beats the reference at every length."""
    for mode in sorted({row["mode"] for row in rows}):
        measured = [r for r in rows if r["mode"] == mode and isinstance(r["times"].get("ours"), float)]
        if not measured:
            continue
        crossover = None
        for row in sorted(measured, key=lambda r: r["tokens"], reverse=True):
            if row["times"]["ours"] < row["times"]["torch"]:
                crossover = row["tokens"]
            else:
                break
        default = "DEFAULT_MIN_TOKENS" if mode == "eager" else "DEFAULT_MIN_TOKENS_IN_GRAPH"
        if crossover is None:
            note = "the reference wins at the longest measured length: keep the fused path off"
        elif crossover == min(r["tokens"] for r in measured):
            note = "fused wins at every measured length: a threshold of 0 (always) is supported down to here"
        else:
            note = "set the default threshold to this token count"
        emit(bench="crossover", mode=mode, default=default, fused_wins_from_tokens=crossover, note=note)


def sweep_launch_shapes(args, device, dtype):
    """Graph-replay time of our kernel per (tile_elements, num_warps): pure GPU time, no host overhead."""
    for seq in args.sweep_seqs:
        inputs = make_op_inputs(args.batch, seq, args.heads, args.head_dim, dtype, device)
        results = []
        for tile in (512, 1024, 2048, 4096, 8192):
            for warps in (1, 2, 4, 8):
                seconds = time_graph(_fused_with(inputs, tile, warps), device, args.iters, args.repeats)
                results.append((seconds, tile, warps))
                emit(bench="sweep", tokens=args.batch * seq, tile_elements=tile, num_warps=warps, us=_us(seconds))
        seconds, tile, warps = min(results)
        moved = 6 * inputs[0][:, :, 0].numel() * inputs[0].element_size()  # read q, k, v; write q, k, v
        emit(bench="sweep_best", tokens=args.batch * seq, tile_elements=tile, num_warps=warps, us=_us(seconds),
             gbytes_per_s=round(moved / seconds / 1e9, 1),
             current=dict(tile_elements=qnr.TILE_ELEMENTS, num_warps=qnr.NUM_WARPS))  # fmt: skip


def _fused_with(inputs, tile, warps):
    qkv, q_w, k_w, cos, sin, k_out, v_out = inputs
    return lambda: qnr.qk_norm_rope_fused(
        qkv, q_w, k_w, cos, sin, EPS, k_out, v_out, tile_elements=tile, num_warps=warps
    )


# ---------------------------------------------------------------------------------------------------------
# Part 2: the model's decode step
# ---------------------------------------------------------------------------------------------------------


def build_transformer(config, device, dtype):
    from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = QwenImage21Transformer(config).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # non-trivial norm weights, so the weight multiply is exercised
        for block in model.transformer_blocks:
            block.attn.norm_q_weight.uniform_(0.5, 1.5)
            block.attn.norm_k_weight.uniform_(0.5, 1.5)
    return model


def set_fusion(enabled: bool):
    """Force the gate for every qk_norm_rope call the transformer makes, eager and in-graph (the defaults it reads)."""
    value = 0 if enabled else NEVER
    qnr.DEFAULT_MIN_TOKENS = qnr.DEFAULT_MIN_TOKENS_IN_GRAPH = value


def bench_decode(args, device, dtype):
    from qwen21_nodes.qwen21_core.config import TransformerConfig

    if args.tiny:
        config = TransformerConfig(in_channels=16, out_channels=16, num_layers=2, attention_head_dim=32,
                                   num_attention_heads=2, context_in_dim=48, axes_dims_rope=(8, 12, 12))  # fmt: skip
        resolutions, prompt_tokens = [(64, 4)], 7  # (pixels, latent grid side)
    else:
        config = TransformerConfig()
        resolutions, prompt_tokens = [(512, 32), (1024, 64)], 128
    model = build_transformer(config, device, dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randn(prompt_tokens, config.context_in_dim, generator=gen).to(device, dtype)
    saved = qnr.DEFAULT_MIN_TOKENS, qnr.DEFAULT_MIN_TOKENS_IN_GRAPH
    try:
        for pixels, side in resolutions:
            bench_decode_resolution(args, model, prompt, pixels, side, gen)
    finally:
        qnr.DEFAULT_MIN_TOKENS, qnr.DEFAULT_MIN_TOKENS_IN_GRAPH = saved


def bench_decode_resolution(args, model, prompt, pixels, side, gen):
    from qwen21_nodes.qwen21_core.dit.decode_graphs import cuda_graph_capture
    from qwen21_nodes.qwen21_core.dit.sequence import build_layout

    device = model.device
    layout = build_layout(torch.zeros(prompt.shape[0], dtype=torch.bool), [], (side, side))
    branch = model.new_branch(layout, batch=1)
    model.prefill(branch, prompt, None)
    x = torch.randn(1, layout.target_len, model.config.in_channels, generator=gen).to(device, model.dtype)
    t = torch.full((1,), 0.5, device=device)

    def decode(x_in=x, t_in=t):
        return model.decode(branch, x_in, t_in)

    modes = ["eager"] + (["graph"] if device.type == "cuda" and not args.no_graph else [])
    outputs, times = {}, {}
    for fused in (False, True):
        if fused and not _triton.triton_runs_on(device):
            continue
        set_fusion(fused)
        label = "fused" if fused else "reference"
        outputs[label] = decode()
        for mode in modes:
            if mode == "eager":
                times[(mode, label)] = time_eager(decode, device, 1, args.decode_repeats)
            else:
                graph, _ = cuda_graph_capture(decode, x.clone(), t.clone())
                times[(mode, label)] = time_eager(graph.replay, device, 1, args.decode_repeats)
                del graph
    for mode in modes:
        row = dict(bench="decode_step", resolution=pixels, target_tokens=layout.target_len,
                   prefix_tokens=layout.prefix_len, mode=mode)  # fmt: skip
        for label in ("reference", "fused"):
            if (mode, label) in times:
                row[f"{label}_ms"] = round(times[(mode, label)] * 1e3, 3)
        if "fused_ms" in row:
            row["speedup"] = round(row["reference_ms"] / row["fused_ms"], 4)
            row["max_abs_diff_fused_vs_reference"] = float((outputs["fused"] - outputs["reference"]).abs().max())
        else:
            row["fused_ms"] = "unavailable (Triton cannot run on this device)"
        emit(**row)
    branch.release()


# ---------------------------------------------------------------------------------------------------------


def _ours_status(device):
    if not _triton.triton_runs_on(device):
        return "unavailable (reference only)"
    if device.type == "cpu":
        return "Triton interpreter (its fp32->bf16 casts truncate: bf16 accuracy here is not the GPU's)"
    return "fused kernel"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--seqs", type=int, nargs="+", help="sequence lengths (tokens per batch row)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20, help="calls per timed sample")
    parser.add_argument("--repeats", type=int, default=15, help="timed samples (the median is reported)")
    parser.add_argument("--decode-repeats", type=int, default=10)
    parser.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timings")
    parser.add_argument("--no-decode", action="store_true", help="skip the full-model decode step")
    parser.add_argument("--sweep", action="store_true", help="also sweep our kernel's launch shape")
    parser.add_argument("--sweep-seqs", type=int, nargs="+", default=[1024, 4096, 20480])
    args = parser.parse_args()

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    if args.tiny:
        args.heads, args.head_dim = 2, 16
        args.seqs = args.seqs or [3, 9]
        args.iters, args.repeats, args.decode_repeats = 1, 2, 1
        args.sweep_seqs = [9]
    args.seqs = args.seqs or [16, 64, 256, 1024, 2048, 4096, 8192, 20480]

    kitchen, kitchen_status = comfy_kitchen_variants(device)
    emit(bench="env", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         torch=torch.__version__, triton=_triton.triton.__version__ if _triton.TRITON_AVAILABLE else "unavailable",
         ours=_ours_status(device),
         comfy_kitchen=kitchen_status, comfy_kitchen_variants=sorted(kitchen), dtype=args.dtype,
         defaults=dict(min_tokens=qnr.DEFAULT_MIN_TOKENS, min_tokens_in_graph=qnr.DEFAULT_MIN_TOKENS_IN_GRAPH,
                       tile_elements=qnr.TILE_ELEMENTS, num_warps=qnr.NUM_WARPS))  # fmt: skip

    with torch.no_grad():
        rows = bench_op(args, device, dtype, kitchen)
        report_crossovers(rows)
        if args.sweep and _triton.triton_runs_on(device) and device.type == "cuda":
            sweep_launch_shapes(args, device, dtype)
        if not args.no_decode:
            bench_decode(args, device, dtype)


if __name__ == "__main__":
    main()
