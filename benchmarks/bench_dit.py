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
import statistics
import time

import torch
from _common import emit, random_dit, sync
from dit_reference import reference_velocity
from qwen21_nodes.kernels import qk_norm_rope
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
from qwen21_nodes.qwen21_core.dit.kv_cache import KVCacheSpec
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.dit.transformer import QUANTIZABLE, uniform_plan
from qwen21_nodes.qwen21_core.quant import linear as quant_linear
from qwen21_nodes.qwen21_core.quant.weights import FORMATS

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
    """Ours with random weights (_common.random_dit), and diffusers' with the same weights."""
    ours = random_dit(TransformerConfig(**config_kwargs), device, dtype)
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
    default_kv = KVCacheSpec()  # what new_branch uses when given none: the layout and format measured here
    result = dict(what="dit_case", case=name, res=res, nref=nref, cfg=cfg, batch=batch, prefix_tokens=layout.prefix_len,
                  target_tokens=layout.target_len, kv_layout=default_kv.layout, kv_cache=default_kv.fmt)  # fmt: skip

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
        result["_ours_v"] = ours_v
        for b in branches:
            b.release()

        # ---- ours, CUDA-graph replay (and the prefill through the graph manager's adopted branches)
        if device.type == "cuda":
            graphs = DecodeGraphs(ours, launch_bound_share=0)
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
    emit(**{k: v for k, v in result.items() if not k.startswith("_")})
    return result


# ---- quantised weights (issue 13) -------------------------------------------------------------------------


def weight_gib(model):
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30


def quant_case(name, res, nref, cfg, batch, ours, fmt_name, keep, bf16_result, args, device, dtype):
    """Our decode with quantised block Linears against our bf16 path (same weights, same inputs, same process)."""
    config = ours.config
    branches_n = 2 if cfg > 1 else 1
    mask, embeds, cond, x, shapes, target = case_inputs(res, nref, batch, config, device, dtype, seed=res + nref)
    t = torch.full((batch,), 0.5, device=device, dtype=dtype)
    layout = build_layout(mask, shapes, target)
    plan = uniform_plan(FORMATS[fmt_name], config.num_layers, keep)
    qmodel = ours.quantized_copy(plan)
    row = dict(what="dit_quant", case=name, format=fmt_name, keep=list(keep), weights_gib=round(weight_gib(qmodel), 2),
               bf16_weights_gib=round(weight_gib(ours), 2))  # fmt: skip
    with torch.inference_mode():
        branches = [qmodel.new_branch(layout, batch, args.attention) for _ in range(branches_n)]

        def prefill_all():
            for b in branches:
                qmodel.prefill(b, embeds, cond)

        row["prefill_ms"] = round(timed(prefill_all, device, max(1, args.iters // 4), warmup=1), 2)
        row["decode_eager_ms"] = round(timed(lambda: [qmodel.decode(b, x, t) for b in branches], device, args.iters), 2)
        eager_v = qmodel.decode(branches[0], x, t, in_graph=True).float()
        for b in branches:
            b.release()
        row["velocity_psnr_vs_bf16_db"] = round(psnr(eager_v, bf16_result["_ours_v"]), 2)
        row["velocity_rel_error_vs_bf16"] = round(((eager_v - bf16_result["_ours_v"]).norm()
                                                   / bf16_result["_ours_v"].norm()).item(), 5)  # fmt: skip
        decode_best = row["decode_eager_ms"]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            graphs = DecodeGraphs(qmodel, launch_bound_share=0)
            gbranches = [
                graphs.new_branch(layout, batch, args.attention, r) for r in ("positive", "negative")[:branches_n]
            ]
            for b in gbranches:
                qmodel.prefill(b, embeds, cond)
            graph_v = [graphs(b, x, t) for b in gbranches][0].float()
            row["graph_status"] = graphs.describe()
            row["decode_graph_ms"] = round(timed(lambda: [graphs(b, x, t) for b in gbranches], device, args.iters), 2)
            row["graph_equals_eager"] = bool(torch.equal(graph_v, eager_v))
            row["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            graphs.clear()
            decode_best = row["decode_graph_ms"]
    row["first_step_ms"] = round(row["prefill_ms"] + decode_best, 2)
    row["40_steps_s"] = round((row["prefill_ms"] + STEPS * decode_best) / 1e3, 3)
    bf16_best = bf16_result.get("ours_decode_graph_ms", bf16_result["ours_decode_eager_ms"])
    row["decode_ratio_vs_our_bf16"] = round(decode_best / bf16_best, 3)
    if "diffusers_decode_ms" in bf16_result:
        row["decode_ratio_vs_diffusers"] = round(decode_best / bf16_result["diffusers_decode_ms"], 3)
        row["total_ratio_vs_diffusers"] = round(row["40_steps_s"] / bf16_result["diffusers_40_steps_s"], 3)
    row["total_ratio_vs_our_bf16"] = round(row["40_steps_s"] / bf16_result["ours_40_steps_s"], 3)
    if args.linear_errors and name == "1024_ref0_cfg1_b1" and not keep:
        row["linear_rel_error"] = linear_errors(ours, qmodel, layout, embeds, cond, x, t, args)
    emit(**row)
    return row


def linear_errors(ours, qmodel, layout, embeds, cond, x, t, args, blocks=(0, 15, 31)):
    """Relative error of each quantised Linear on the activations it really sees: each block's inputs are
    recorded in a bf16 decode, the Linears' bf16 inputs recomputed from them, both layers applied."""
    import torch.nn.functional as F

    recorded = {}
    originals = {}
    for i in blocks:
        block = ours.transformer_blocks[i]
        originals[i] = block._finish

        def record(xb, attn, mod, fns, i=i, block=block):
            recorded[i] = (xb, attn.flatten(2), mod)
            return originals[i](xb, attn, mod, fns)

        block._finish = record
    try:
        branch = ours.new_branch(layout, x.shape[0])
        ours.prefill(branch, embeds, cond)
        ours.decode(branch, x, t)
        branch.release()
    finally:
        for i in blocks:
            del ours.transformer_blocks[i]._finish
    errors = {}
    for i, (xb, attn, mod) in recorded.items():
        block, qblock = ours.transformer_blocks[i], qmodel.transformer_blocks[i]
        d = xb.shape[-1]
        norm = F.layer_norm(xb, (d,), eps=block.eps)
        x_mid = xb + mod.gate1 * F.linear(attn, block.attn.to_out.weight)
        h = F.layer_norm(x_mid, (d,), eps=block.eps) * mod.scale2
        gate, up = F.linear(h, block.img_mlp.gate_up.weight).chunk(2, dim=-1)
        inputs = {"attn.to_qkv": norm * mod.scale1, "attn.to_out": attn, "img_mlp.gate_up": h,
                  "img_mlp.out": F.silu(gate) * up}  # fmt: skip
        for path, a in inputs.items():
            want = F.linear(a.float(), block.get_submodule(path).weight.float())
            got = qblock.get_submodule(path)(a).float()
            errors.setdefault(path, []).append(round(((got - want).norm() / want.norm()).item(), 5))
    return errors


def sensitivity(ours, args, device, dtype, fmt_name):
    """Velocity PSNR vs bf16 with only one layer type (all blocks) or one block (all types) quantised."""
    res, nref = (64 if args.tiny else 1024), 0
    mask, embeds, cond, x, shapes, target = case_inputs(res, nref, 1, ours.config, device, dtype, seed=res)
    t = torch.full((1,), 0.5, device=device, dtype=dtype)
    layout = build_layout(mask, shapes, target)
    fmt = FORMATS[fmt_name]

    def velocity(model):
        branch = model.new_branch(layout, 1)
        model.prefill(branch, embeds, cond)
        v = model.decode(branch, x, t).float()
        branch.release()
        return v

    with torch.inference_mode():
        reference = velocity(ours)
        groups = {f"type:{path}": {(i, path): fmt for i in range(ours.config.num_layers)} for path in QUANTIZABLE}
        groups |= {f"block:{i}": {(i, path): fmt for path in QUANTIZABLE} for i in range(ours.config.num_layers)}
        for label, plan in groups.items():
            qmodel = ours.quantized_copy(plan)
            v = velocity(qmodel)
            emit(what="dit_quant_sensitivity", format=fmt_name, layers=label,
                 velocity_psnr_vs_bf16_db=round(psnr(v, reference), 2),
                 velocity_rel_error=round(((v - reference).norm() / reference.norm()).item(), 6))  # fmt: skip
            del qmodel


def latent_quality(ours, args, device, dtype, formats):
    """40-step latents from one seed: each quantised model against bf16 (the sampler with graphs, 1024^2 t2i)."""
    from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
    from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER
    from qwen21_nodes.qwen21_core.sampler import Sampler

    res = 64 if args.tiny else 1024
    mask, embeds, _, _, _, _ = case_inputs(res, 0, 1, ours.config, device, dtype, seed=7)
    cond = Conditioning(PromptEmbedding(embeds, mask.to(device)), width=res, height=res)
    zeros = torch.zeros(ours.config.in_channels)

    def run(model):
        graphs = DecodeGraphs(model, launch_bound_share=0) if device.type == "cuda" else None
        start = time.perf_counter()
        out = Sampler(model, QWEN21_SCHEDULER, zeros, zeros + 1, decode_runner=graphs).sample(
            [cond], height=res, width=res, steps=STEPS, seed=3
        )
        sync(device)
        seconds = time.perf_counter() - start
        if graphs is not None:
            graphs.clear()
        return out.float(), seconds

    with torch.inference_mode():
        reference, bf16_s = run(ours)
        emit(what="dit_quant_latents", format="bf16", seconds=round(bf16_s, 2))
        for fmt_name in formats:
            qmodel = ours.quantized_copy(uniform_plan(FORMATS[fmt_name], ours.config.num_layers))
            latents, seconds = run(qmodel)
            emit(what="dit_quant_latents", format=fmt_name, steps=STEPS, seconds=round(seconds, 2),
                 latents_psnr_vs_bf16_db=round(psnr(latents, reference), 2),
                 seconds_ratio_vs_bf16=round(seconds / bf16_s, 3))  # fmt: skip
            del qmodel


def profile_step(ours, args, device, dtype, formats):
    """Where a 1024^2 decode step's time goes: the top CUDA kernels (eager, so each kernel is visible)."""
    from torch.profiler import ProfilerActivity, profile

    mask, embeds, cond, x, shapes, target = case_inputs(1024, 0, 1, ours.config, device, dtype, seed=1024)
    t = torch.full((1,), 0.5, device=device, dtype=dtype)
    layout = build_layout(mask, shapes, target)
    for fmt_name in ["bf16", *formats]:
        plan = uniform_plan(FORMATS[fmt_name], ours.config.num_layers) if fmt_name != "bf16" else None
        model = ours if plan is None else ours.quantized_copy(plan)
        if fmt_name == "fp8":
            with torch.inference_mode():  # the same step with fast-accumulation FP8 GEMMs, in the same process
                branch = model.new_branch(layout, 1)
                model.prefill(branch, embeds, cond)
                for fast in (False, True):
                    quant_linear.FP8_FAST_ACCUM = fast
                    ms = timed(lambda b=branch: model.decode(b, x, t), device, args.iters)
                    v = model.decode(branch, x, t).float()
                    emit(what="dit_fp8_accumulation", fast_accum=fast, decode_eager_ms=round(ms, 2),
                         velocity_rms=round(v.pow(2).mean().sqrt().item(), 5))  # fmt: skip
                quant_linear.FP8_FAST_ACCUM = True
                branch.release()
        with torch.inference_mode():
            branch = model.new_branch(layout, 1)
            model.prefill(branch, embeds, cond)
            for _ in range(2):
                model.decode(branch, x, t)
            sync(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    model.decode(branch, x, t)
                sync(device)
            branch.release()
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in events)
        top = sorted(events, key=lambda e: -e.device_time_total)[:14]
        emit(what="dit_profile", format=fmt_name, step_kernel_ms=round(total / 3 / 1e3, 2),
             top=[[e.key[:60], round(e.device_time_total / 3 / 1e3, 2), e.count // 3] for e in top])  # fmt: skip
        if model is not ours:
            del model


def kv_and_streaming(ours, args, device, dtype):
    """Issue 14 in one process: the K/V layouts, formats and placements, and DiT block streaming, at 1024^2 (t2i and
    4 references): decode ms (graph replay), device bytes of the caches, velocity PSNR against the bf16 split cache;
    then 40-step latents with a quantised cache against the bf16 cache (1 reference)."""

    res = 64 if args.tiny else 1024
    for nref in (0, 4):
        mask, embeds, cond, x, shapes, target = case_inputs(res, nref, 1, ours.config, device, dtype, seed=9 + nref)
        t = torch.full((1,), 0.5, device=device, dtype=dtype)
        layout = build_layout(mask, shapes, target)
        reference = None
        variants = [("bf16", "gpu", "split"), ("bf16", "gpu", "joint"), ("fp8", "gpu", "split"),
                    ("fp8_v", "gpu", "split"), ("int8", "gpu", "split"), ("bf16", "cpu", "split"),
                    ("fp8", "cpu", "split")]  # fmt: skip
        for fmt, placement, kv_layout in variants:
            kv = KVCacheSpec(fmt, placement, kv_layout)
            with torch.inference_mode():
                graphs = DecodeGraphs(ours, launch_bound_share=0) if device.type == "cuda" else None
                branch = (
                    graphs.new_branch(layout, 1, args.attention, kv=kv) if graphs else ours.new_branch(layout, 1, kv=kv)
                )
                ours.prefill(branch, embeds, cond)
                step = (lambda: graphs(branch, x, t)) if graphs else (lambda: ours.decode(branch, x, t))
                v = step().float()
                ms = timed(step, device, args.iters)
                row = dict(what="dit_kv", res=res, nref=nref, kv_cache=fmt, placement=placement, layout=kv_layout,
                           decode_ms=round(ms, 2), cache_device_mib=round(branch.cache.nbytes / 2**20, 1),
                           cache_host_mib=round(branch.cache.host_nbytes / 2**20, 1),
                           prefix_tokens=layout.prefix_len)  # fmt: skip
                if reference is None:
                    reference = v
                else:
                    row["velocity_psnr_vs_bf16_split_db"] = round(psnr(v, reference), 2)
                    row["equals_bf16_split"] = bool(torch.equal(v, reference))
                if graphs:
                    row["graph"] = graphs.describe()
                    graphs.clear()
                else:
                    branch.release()
            emit(**row)
        # block streaming: resident blocks from all to none, bf16 and fp8 weights
        for fmt_name in ("bf16", "fp8"):
            model = (
                ours
                if fmt_name == "bf16"
                else ours.quantized_copy(uniform_plan(FORMATS["fp8"], ours.config.num_layers))
            )
            for resident in (None, 24, 16, 8, 0):
                if nref and resident not in (None, 16):
                    continue
                model.stream_blocks(resident)
                with torch.inference_mode():
                    graphs = DecodeGraphs(model, launch_bound_share=0) if device.type == "cuda" else None
                    branch = graphs.new_branch(layout, 1, args.attention) if graphs else model.new_branch(layout, 1)
                    model.prefill(branch, embeds, cond)
                    step = (lambda: graphs(branch, x, t)) if graphs else (lambda: model.decode(branch, x, t))
                    v = step().float()
                    if resident is None:
                        whole = v
                    ms = timed(step, device, max(3, args.iters // 2))
                    emit(what="dit_streaming", res=res, nref=nref, weights=fmt_name,
                         resident_blocks=model.resident_blocks, decode_ms=round(ms, 2),
                         device_weight_gib=round(model.device_weight_bytes() / 2**30, 2),
                         equals_resident=bool(torch.equal(v, whole)),
                         graph=graphs.describe() if graphs else "eager")  # fmt: skip
                    if graphs:
                        graphs.clear()
                    else:
                        branch.release()
            model.place(device)
            if model is not ours:
                del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    latents_with_kv(ours, args, device, dtype)


def latents_with_kv(ours, args, device, dtype):
    """40 steps with 1 reference (1024^2): the quantised caches' latents against the bf16 cache's."""
    from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
    from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER
    from qwen21_nodes.qwen21_core.options import SampleOptions
    from qwen21_nodes.qwen21_core.sampler import Sampler

    res = 64 if args.tiny else 1024
    mask, embeds, cond_tokens, _, shapes, _ = case_inputs(res, 1, 1, ours.config, device, dtype, seed=21)
    lat = res // 16
    condition = cond_tokens.float().T.reshape(ours.config.in_channels, lat, lat)
    cond = Conditioning(PromptEmbedding(embeds, mask.to(device)), condition_latents=[condition], width=res, height=res)
    zeros = torch.zeros(ours.config.in_channels)
    results = {}
    for fmt in ("bf16", "fp8", "fp8_v", "int8"):
        with torch.inference_mode():
            graphs = DecodeGraphs(ours, launch_bound_share=0) if device.type == "cuda" else None
            options = SampleOptions(kv_cache=fmt, kv_placement="gpu")
            sampler = Sampler(ours, QWEN21_SCHEDULER, zeros, zeros + 1, options=options, decode_runner=graphs)
            start = time.perf_counter()
            results[fmt] = sampler.sample([cond], height=res, width=res, steps=STEPS, seed=5).float()
            sync(device)
            seconds = time.perf_counter() - start
            if graphs:
                graphs.clear()
        row = dict(what="dit_kv_latents", kv_cache=fmt, nref=1, steps=STEPS, seconds=round(seconds, 2),
                   cache_mib=sampler.stats.as_dict()["prefix_cache_mib"])  # fmt: skip
        if fmt != "bf16":
            row["latents_psnr_vs_bf16_cache_db"] = round(psnr(results[fmt], results["bf16"]), 2)
        emit(**row)


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
            graphs = DecodeGraphs(ours, launch_bound_share=0)
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
    parser.add_argument("--cases", default="", help="run only cases whose name contains one of these (a,b,...)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-backends", action="store_true")
    parser.add_argument("--no-fp32", action="store_true", help="skip the fp32 copies used to judge agreement")
    parser.add_argument("--formats", default="", help="quantised formats to compare, e.g. fp8,int8,int8_convrot")
    parser.add_argument("--keep-mlp", action="store_true", help="also run each format with the MLP kept in bf16")
    parser.add_argument("--linear-errors", action="store_true", help="per-Linear errors on recorded activations")
    parser.add_argument("--quality", action="store_true", help="40-step latents of each format against bf16")
    parser.add_argument("--sensitivity", default="", help="per-layer sensitivity table for this format")
    parser.add_argument("--profile", action="store_true", help="top kernels of a 1024^2 decode step per format")
    parser.add_argument("--bf16-only", action="store_true", help="skip the bf16 extras (backends, compile)")
    parser.add_argument("--kv", action="store_true", help="K/V layouts, formats, placements and block streaming")
    parser.add_argument("--keep-mlp-cases", default="1024_ref0", help="cases that also run --keep-mlp")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config_kwargs = TINY_CONFIG if args.tiny else {}
    start = time.perf_counter()
    ours, reference = build_models(config_kwargs, device, dtype, not args.no_reference)
    emit(what="setup", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         torch=torch.__version__, dtype=str(dtype), init_s=round(time.perf_counter() - start, 1),
         params_b=round(sum(p.numel() for p in ours.parameters()) / 1e9, 3),
         qk_norm_rope_min_tokens=qk_norm_rope.DEFAULT_MIN_TOKENS,
         float32_matmul_precision=torch.get_float32_matmul_precision())  # fmt: skip
    args.fp32_reference = args.fp32_ours = None
    if reference is not None and not args.no_fp32:
        import copy

        args.fp32_reference = copy.deepcopy(reference).float()
        args.fp32_ours = copy.deepcopy(ours).float()
    cases = []
    for res, nref, cfg, batch in TINY_CASES if args.tiny else FULL_CASES:
        name = f"{res}_ref{nref}_cfg{cfg:g}_b{batch}"
        if any(part in name for part in args.cases.split(",")):
            cases.append((name, res, nref, cfg, batch))
    formats = [f for f in args.formats.split(",") if f]
    results = {}
    for name, res, nref, cfg, batch in cases:
        results[name] = run_case(name, res, nref, cfg, batch, ours, reference, args, device, dtype)
        for fmt_name in formats:
            keep_mlp = args.keep_mlp and any(part in name for part in args.keep_mlp_cases.split(","))
            for keep in [()] + ([("img_mlp.gate_up", "img_mlp.out")] if keep_mlp else []):
                quant_case(name, res, nref, cfg, batch, ours, fmt_name, keep, results[name], args, device, dtype)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the quantised copy is gone; give its memory back before the next
        results[name].pop("_ours_v")
    args.fp32_reference = args.fp32_ours = None  # free the fp32 copies before the compile runs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.profile and device.type == "cuda":
        profile_step(ours, args, device, dtype, formats)
    if args.quality:
        latent_quality(ours, args, device, dtype, formats)
    if args.sensitivity:
        for fmt_name in args.sensitivity.split(","):
            sensitivity(ours, args, device, dtype, fmt_name)
    if args.kv:
        kv_and_streaming(ours, args, device, dtype)
    if args.bf16_only:
        return
    if not args.no_backends:
        attention_backends(ours, args, device, dtype)
    if not args.no_compile:
        compile_cases(cases, ours, reference, args, device, dtype, results)


if __name__ == "__main__":
    main()
