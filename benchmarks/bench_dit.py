"""DiT speed and agreement: our prefill/decode (eager, CUDA graphs, + regional compile) against the
diffusers 0.42.1 reference (eager and `compile_repeated_blocks`) in ONE process on identical random
full-size weights, bf16. Prints one JSON line per measurement.

    python benchmarks/bench_dit.py                 # H200: all cases
    python benchmarks/bench_dit.py --cases 1024    # only cases whose name contains "1024"
    python benchmarks/bench_dit.py --tiny --device cpu   # smoke test of the script itself

Case names: <res>_ref<n>_cfg<s>_b<batch>. The prompt has 128 text tokens (+4 per condition image),
laid out like the shared baseline: half the text, then each condition image followed by 4 text
tokens, then the rest; condition images are res x res.
Per case: first step (ours: prefill + decode; diffusers: extract), decode step (ours eager / graph /
compiled+graph; diffusers eager / compiled), the 40-step DiT total, peak memory, ratios to diffusers,
and the agreement of our decode velocity with diffusers' (max abs, PSNR).
"""

# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
from _common import emit, sync
from dit_reference import reference_velocity
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer

TEXT_TOKENS = 128
STEPS = 40
FULL_CASES = [
    (512, 0, 1.0, 1),
    (1024, 0, 1.0, 1),
    (2048, 0, 1.0, 1),
    (1024, 1, 1.0, 1),
    (1024, 4, 1.0, 1),
    (1024, 0, 4.0, 1),
    (1024, 1, 4.0, 1),
    (1024, 0, 1.0, 4),
]
TINY_CASES = [(64, 0, 1.0, 1), (64, 1, 4.0, 1), (64, 0, 1.0, 2)]
COMPILE_CASES = {"512_ref0_cfg1_b1", "1024_ref0_cfg1_b1", "1024_ref4_cfg1_b1"}
# bf16 rounding differences grow through 32 random-weight layers, so agreement is judged against an fp32
# copy of the reference: ours and diffusers (both bf16) should be equally close to it.
FP32_CASES = {"512_ref0_cfg1_b1", "1024_ref0_cfg1_b1", "1024_ref1_cfg1_b1", "64_ref0_cfg1_b1", "64_ref1_cfg4_b1"}
TINY_CONFIG = dict(num_layers=2, attention_head_dim=32, num_attention_heads=2, context_in_dim=64, in_channels=16,
                   out_channels=16, axes_dims_rope=(8, 12, 12))  # fmt: skip


def timed(fn, device, iters, warmup=2):
    """Median wall time in ms (synchronised)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def psnr(a, b):
    a, b = a.float(), b.float()
    mse = (a - b).pow(2).mean().item()
    peak = b.abs().max().item()
    return float("inf") if mse == 0 else 10 * math.log10(peak * peak / mse)


def build_models(config_kwargs, device, dtype, with_reference):
    """Ours with random weights, and diffusers' with the same weights.

    Matrices are normal with std 1/sqrt(3 fan_in) (the spread of torch's default Linear init, which the
    shared diffusers baseline used); norm weights 1, the zero-centred text norm 0.
    """
    config = TransformerConfig(**config_kwargs)
    with torch.device("meta"):
        ours = QwenImage21Transformer(config).to(dtype)
    ours.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if name.endswith("text_norm.weight"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0, (3 * param.shape[1]) ** -0.5, generator=gen)
    ours.eval()
    reference = None
    if with_reference:
        from diffusers import QwenImage21Transformer2DModel

        with torch.device(device):
            reference = QwenImage21Transformer2DModel(**config_kwargs).to(dtype).eval()
        with torch.no_grad():
            reference.load_state_dict({k: v for k, v in ours.checkpoint_slots().items()})
    return ours, reference


def case_inputs(res, nref, batch, config, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lat = res // 16
    slots = lat * lat // 4
    parts = [torch.zeros(TEXT_TOKENS // 2, dtype=torch.bool)]
    for _ in range(nref):
        parts += [torch.ones(slots, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)]
    parts.append(torch.zeros(TEXT_TOKENS - TEXT_TOKENS // 2, dtype=torch.bool))
    mask = torch.cat(parts)
    embeds = torch.randn(mask.shape[0], config.context_in_dim, generator=g).to(device, dtype)
    cond = torch.randn(nref * lat * lat, config.in_channels, generator=g).to(device, dtype) if nref else None
    x = torch.randn(batch, lat * lat, config.in_channels, generator=g).to(device, dtype)
    return mask, embeds, cond, x, [(lat, lat)] * nref, (lat, lat)


def reference_call(reference, mask, embeds, cond, x, shapes, target, t, cache=None, mode=None):
    """The reference's velocity for a case, through its K/V cache when given (the parity tests' adapter)."""
    return reference_velocity(
        reference, embeds, mask, cond, shapes, x, t, target_shape=target, kv_cache=cache, kv_cache_mode=mode
    )


def run_case(name, res, nref, cfg, batch, ours, reference, args, device, dtype):
    config = ours.config
    branches_n = 2 if cfg > 1 else 1
    mask, embeds, cond, x, shapes, target = case_inputs(res, nref, batch, config, device, dtype, seed=res + nref)
    t = torch.full((batch,), 0.5, device=device, dtype=dtype)
    layout = build_layout(mask, shapes, target)
    iters = args.iters
    result = dict(what="dit_case", case=name, res=res, nref=nref, cfg=cfg, batch=batch, prefix_tokens=layout.prefix_len,
                  target_tokens=layout.target_len)  # fmt: skip

    with torch.inference_mode():
        # ---- ours, eager
        branches = [ours.new_branch(layout, batch, args.attention) for _ in range(branches_n)]
        result["ours_cache_mib"] = round(sum(b.cache.nbytes for b in branches) / 2**20, 1)

        def prefill_all():
            for b in branches:
                ours.prefill(b, embeds, cond)

        result["ours_prefill_ms"] = round(timed(prefill_all, device, max(1, iters // 4), warmup=1), 2)

        def decode_all():
            return [ours.decode(b, x, t) for b in branches]

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        result["ours_decode_eager_ms"] = round(timed(decode_all, device, iters), 2)
        if device.type == "cuda":
            result["ours_decode_peak_extra_mib"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)
            reserved = torch.cuda.memory_reserved(device)
            decode_all()
            sync(device)
            result["ours_decode_reserved_growth_bytes"] = torch.cuda.memory_reserved(device) - reserved
        ours_v = decode_all()[0].float()
        for b in branches:
            b.release()

        # ---- ours, CUDA-graph replay (and the prefill through the graph manager's adopted branches)
        if device.type == "cuda":
            graphs = DecodeGraphs(ours)
            gbranches = [
                graphs.new_branch(layout, batch, args.attention, r) for r in ("positive", "negative")[:branches_n]
            ]
            for b in gbranches:
                ours.prefill(b, embeds, cond)
            start = time.perf_counter()
            graph_v = [graphs(b, x, t) for b in gbranches][0].float()
            sync(device)
            result["ours_graph_capture_ms"] = round((time.perf_counter() - start) * 1e3, 1)
            result["ours_graph_status"] = graphs.describe()
            result["ours_decode_graph_ms"] = round(
                timed(lambda: [graphs(b, x, t) for b in gbranches], device, iters), 2
            )
            result["graph_equals_eager"] = bool(torch.equal(graph_v, ours_v))
            eager_same = ours.decode(gbranches[0], x, t, in_graph=True).float()
            result["graph_equals_eager_same_branch"] = bool(torch.equal(graph_v, eager_same))
            graphs.clear()
            decode_best = result["ours_decode_graph_ms"]
        else:
            decode_best = result["ours_decode_eager_ms"]
        result["ours_first_step_ms"] = round(result["ours_prefill_ms"] + decode_best, 2)
        result["ours_40_steps_s"] = round((result["ours_prefill_ms"] + STEPS * decode_best) / 1e3, 3)

        # ---- diffusers reference
        if reference is not None:
            from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

            caches = [QwenImage21KVCache(len(reference.transformer_blocks)) for _ in range(branches_n)]

            def ref_extract():
                return [
                    reference_call(reference, mask, embeds, cond, x, shapes, target, t, c, "extract") for c in caches
                ]

            def ref_decode():
                return [
                    reference_call(reference, mask, embeds, cond, x, shapes, target, t, c, "cached") for c in caches
                ]

            result["diffusers_first_step_ms"] = round(timed(ref_extract, device, max(1, iters // 4), warmup=1), 2)
            result["diffusers_decode_ms"] = round(timed(ref_decode, device, iters), 2)
            ref_v = ref_decode()[0].float()
            result["agree_maxabs"] = round((ours_v - ref_v).abs().max().item(), 5)
            result["agree_psnr_db"] = round(psnr(ours_v, ref_v), 2)
            if args.fp32_reference is not None and name in FP32_CASES:
                exact = args.fp32_reference
                fp32_in = [None if a is None else a.float() for a in (embeds, cond, x)]
                fp32_v = reference_call(exact, mask, fp32_in[0], fp32_in[1], fp32_in[2], shapes, target, t.float())
                fp32_v = fp32_v.float()
                result["ours_bf16_vs_fp32_reference_psnr_db"] = round(psnr(ours_v, fp32_v), 2)
                result["diffusers_bf16_vs_fp32_reference_psnr_db"] = round(psnr(ref_v, fp32_v), 2)
                fp32_ours = args.fp32_ours
                b32 = fp32_ours.new_branch(layout, batch)
                fp32_ours.prefill(b32, fp32_in[0], fp32_in[1])
                ours32 = fp32_ours.decode(b32, fp32_in[2], t.float()).float()
                b32.release()
                result["ours_fp32_vs_fp32_reference_maxabs"] = float(f"{(ours32 - fp32_v).abs().max().item():.3g}")
            result["diffusers_40_steps_s"] = round(
                (result["diffusers_first_step_ms"] + (STEPS - 1) * result["diffusers_decode_ms"]) / 1e3, 3
            )
            result["decode_ratio_vs_diffusers"] = round(decode_best / result["diffusers_decode_ms"], 3)
            result["total_ratio_vs_diffusers"] = round(result["ours_40_steps_s"] / result["diffusers_40_steps_s"], 3)
            del caches
        if device.type == "cuda":
            result["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    emit(**result)
    return result


def compile_cases(cases, ours, reference, args, device, dtype, eager_results):
    """Ours: regional compile + graphs. Diffusers: compile_repeated_blocks. Same process, after the eager runs."""
    if device.type != "cuda":
        return
    start = time.perf_counter()
    ours.compile_blocks()
    for name, res, nref, _cfg, batch in cases:
        if name not in COMPILE_CASES:
            continue
        mask, embeds, cond, x, shapes, target = case_inputs(
            res, nref, batch, ours.config, device, dtype, seed=res + nref
        )
        t = torch.full((batch,), 0.5, device=device, dtype=dtype)
        layout = build_layout(mask, shapes, target)
        with torch.inference_mode():
            graphs = DecodeGraphs(ours)
            branch = graphs.new_branch(layout, batch, args.attention, "positive")
            ours.prefill(branch, embeds, cond)
            t0 = time.perf_counter()
            compiled_v = graphs(branch, x, t).float()
            sync(device)
            first = time.perf_counter() - t0
            ms = timed(lambda: graphs(branch, x, t), device, args.iters)
            eager_v = None
            ours.compile_blocks(False)
            eager_v = ours.decode(branch, x, t).float()
            ours.compile_blocks()
            graphs.clear()
        row = dict(
            what="dit_compiled",
            case=name,
            ours_compiled_graph_decode_ms=round(ms, 2),
            ours_first_call_incl_compile_s=round(first, 1),
            ours_compiled_vs_eager_psnr_db=round(psnr(compiled_v, eager_v), 2),
            ours_compiled_vs_eager_maxabs=round((compiled_v - eager_v).abs().max().item(), 4),
        )
        eager = eager_results.get(name, {})
        if reference is not None:
            if not getattr(reference, "_bench_compiled", False):
                reference.compile_repeated_blocks(fullgraph=False)
                reference._bench_compiled = True
            from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

            cache = QwenImage21KVCache(len(reference.transformer_blocks))
            with torch.inference_mode():
                reference_call(reference, mask, embeds, cond, x, shapes, target, t, cache, "extract")
                t0 = time.perf_counter()
                reference_call(reference, mask, embeds, cond, x, shapes, target, t, cache, "cached")
                sync(device)
                row["diffusers_first_call_incl_compile_s"] = round(time.perf_counter() - t0, 1)

                def ref_decode():
                    return reference_call(reference, mask, embeds, cond, x, shapes, target, t, cache, "cached")

                dms = timed(ref_decode, device, args.iters)
            row["diffusers_compiled_decode_ms"] = round(dms, 2)
            row["ratio_ours_compiled_vs_diffusers_compiled"] = round(ms / dms, 3)
            if "diffusers_decode_ms" in eager:
                row["ratio_ours_compiled_vs_diffusers_eager"] = round(ms / eager["diffusers_decode_ms"], 3)
        if "ours_decode_graph_ms" in eager:
            row["ratio_compiled_vs_our_graph"] = round(ms / eager["ours_decode_graph_ms"], 3)
        emit(**row)
    emit(what="compile_total_s", value=round(time.perf_counter() - start, 1))


def attention_backends(ours, args, device, dtype):
    """Our eager decode with each SDPA backend forced (1024^2 t2i and with 4 references)."""
    if device.type != "cuda":
        return
    for res, nref in ((1024, 0), (1024, 4)):
        mask, embeds, cond, x, shapes, target = case_inputs(res, nref, 1, ours.config, device, dtype, seed=1)
        t = torch.full((1,), 0.5, device=device, dtype=dtype)
        layout = build_layout(mask, shapes, target)
        for backend in ("cudnn", "flash", "efficient"):
            with torch.inference_mode():
                try:
                    branch = ours.new_branch(layout, 1, backend)
                    ours.prefill(branch, embeds, cond)
                    prefill_ms = timed(lambda b=branch: ours.prefill(b, embeds, cond), device, 2, warmup=1)
                    ms = timed(lambda b=branch: ours.decode(b, x, t), device, args.iters)
                    emit(what="attention_backend", res=res, nref=nref, backend=backend, decode_ms=round(ms, 2),
                         prefill_ms=round(prefill_ms, 2))  # fmt: skip
                    branch.release()
                except Exception as error:  # noqa: BLE001 - report, go on
                    emit(what="attention_backend", res=res, nref=nref, backend=backend, error=str(error)[:160])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny random model (smoke test)")
    parser.add_argument("--cases", default="", help="run only cases whose name contains this")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-backends", action="store_true")
    parser.add_argument("--no-fp32", action="store_true", help="skip the fp32 copies used to judge agreement")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config_kwargs = TINY_CONFIG if args.tiny else {}
    start = time.perf_counter()
    ours, reference = build_models(config_kwargs, device, dtype, not args.no_reference)
    emit(what="setup", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         torch=torch.__version__, dtype=str(dtype), init_s=round(time.perf_counter() - start, 1),
         params_b=round(sum(p.numel() for p in ours.parameters()) / 1e9, 3),
         qk_norm_rope_min_tokens=os.environ.get("QWEN21_FUSED_QK_NORM_ROPE_MIN_TOKENS", "default"),
         float32_matmul_precision=torch.get_float32_matmul_precision())  # fmt: skip
    args.fp32_reference = args.fp32_ours = None
    if reference is not None and not args.no_fp32:
        import copy

        args.fp32_reference = copy.deepcopy(reference).float()
        args.fp32_ours = copy.deepcopy(ours).float()
    cases = []
    for res, nref, cfg, batch in TINY_CASES if args.tiny else FULL_CASES:
        name = f"{res}_ref{nref}_cfg{cfg:g}_b{batch}"
        if args.cases in name:
            cases.append((name, res, nref, cfg, batch))
    results = {}
    for name, res, nref, cfg, batch in cases:
        results[name] = run_case(name, res, nref, cfg, batch, ours, reference, args, device, dtype)
    args.fp32_reference = args.fp32_ours = None  # free the fp32 copies before the compile runs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.no_backends:
        attention_backends(ours, args, device, dtype)
    if not args.no_compile:
        compile_cases(cases, ours, reference, args, device, dtype, results)


if __name__ == "__main__":
    main()
