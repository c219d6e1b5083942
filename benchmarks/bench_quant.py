"""Quantised-linear building blocks on one GPU: GEMM rates, the fused quantisation / epilogue kernels against
their unfused torch equivalents, and the error of one Linear. Prints one JSON line per measurement.

    python benchmarks/bench_quant.py              # H200: the block's four projections at M = 4096 (1024^2)
    python benchmarks/bench_quant.py --tiny --device cpu   # smoke test of the script itself

Shapes are one Qwen-Image-2.1 block's: QKV 4096->12288, out 4096->4096, gate_up 4096->24576, down 12288->4096.
Errors are relative Frobenius errors against fp32 math on the same (bf16-rounded) operands, on Gaussian data.
"""

# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _common import emit, sync
from qwen21_nodes.kernels.linear_epilogue import linear_epilogue
from qwen21_nodes.kernels.quantize_rows import LayerNormModulation, quantize_rows, quantize_rows_reference
from qwen21_nodes.qwen21_core.quant.linear import QuantLinear
from qwen21_nodes.qwen21_core.quant.weights import FORMATS

SHAPES = {"qkv": (4096, 12288), "out": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}
TINY_SHAPES = {"qkv": (256, 768), "down": (768, 256)}


def bench(fn, device, iters=20, warmup=3):
    """Median milliseconds (CUDA events), or wall time on CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type != "cuda":
        import time

        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rel_error(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def gemms(m, shapes, device):
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (k, n) in shapes.items():
        x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        w = (torch.randn(n, k, device=device, generator=gen) * k**-0.5).to(torch.bfloat16)
        flops = 2 * m * n * k
        exact = F.linear(x.float(), w.float())
        ms = bench(lambda: F.linear(x, w), device)
        emit(what="gemm", shape=name, kind="bf16", ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1),
             rel_error=round(rel_error(F.linear(x, w), exact), 5))  # fmt: skip
        for fmt_name, fmt in FORMATS.items():
            layer = QuantLinear.from_weight(w, fmt)
            backend = layer.backend(m)
            if backend == "weight_only":
                emit(what="gemm", shape=name, kind=fmt_name, backend=backend, skipped="no W8A8 GEMM on this device")
                continue
            q, s = layer.quantize_input(x)
            ms = bench(lambda: layer.project(q, s, backend), device)
            out = layer.project(q, s, backend).dense(torch.bfloat16)
            row = dict(what="gemm", shape=name, kind=fmt_name, backend=backend, ms=round(ms, 4),
                       tflops=round(flops / ms / 1e9, 1), rel_error=round(rel_error(out, exact), 5))  # fmt: skip
            if backend == "scaled_mm":

                def fast_accum():
                    return torch._scaled_mm(q, layer.qweight.t(), scale_a=s[:, None], out_dtype=torch.bfloat16,
                                            scale_b=layer.weight_scale[None, :], use_fast_accum=True)  # fmt: skip

                row["fast_accum_ms"] = round(bench(fast_accum, device), 4)
                row["fast_accum_rel_error"] = round(rel_error(fast_accum(), exact), 5)
            if backend == "triton_int8":
                from qwen21_nodes.kernels.int8_gemm import chosen_config

                row["triton_config"] = chosen_config(m, n, k, False, device)
                row["int_mm_with_dequant_ms"] = round(bench(lambda: layer.project(q, s, "int_mm").dense(torch.bfloat16),
                                                            device), 4)  # fmt: skip
                row["int_mm_ms"] = round(bench(lambda: torch._int_mm(q, layer.qweight.t()), device), 4)
                row_major = layer.qweight.t().contiguous()
                row["int_mm_row_major_b_ms"] = round(bench(lambda: torch._int_mm(q, row_major), device), 4)
                same = torch.equal(
                    layer.project(q, s, "triton_int8").data, layer.project(q, s, "int_mm").dense(torch.bfloat16)
                )
                row["triton_equals_int_mm_dequant"] = same
            full = bench(lambda: layer(x), device)
            row["unfused_linear_ms"] = round(full, 4)  # quantise x + GEMM + dequant, as a plain Linear call
            kitchen = kitchen_int8_linear(layer, fmt)
            if kitchen is not None:  # comfy-kitchen's int8_linear (native ComfyUI's op) on the same weights
                row["kitchen_int8_linear_ms"] = round(bench(lambda: kitchen(x), device), 4)
                row["kitchen_rel_error"] = round(rel_error(kitchen(x), exact), 5)
            emit(**row)


def kitchen_int8_linear(layer, fmt):
    """comfy-kitchen's int8_linear for this layer's stored (q, scale), or None where it is not installed."""
    if fmt.kind != "int8":
        return None
    try:
        import comfy_kitchen as ck
    except ImportError:
        return None
    scale = layer.weight_scale[:, None]
    return lambda x: ck.int8_linear(x, layer.qweight, scale, None, torch.bfloat16, bool(fmt.rotation), 256)


def kernels(m, d, hidden, device):
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, d, device=device, generator=gen).to(torch.bfloat16)
    mod = (1 + 0.1 * torch.randn(1, d, device=device, generator=gen)).to(torch.bfloat16)
    ln = LayerNormModulation(mod, m, 1e-6)
    gate_up = torch.randn(m, 2 * hidden, device=device, generator=gen).to(torch.bfloat16)
    acc = torch.randint(-(2**20), 2**20, (m, 2 * hidden), device=device, dtype=torch.int32, generator=gen)
    rs = torch.rand(m, device=device, generator=gen) * 1e-5
    cs = torch.rand(2 * hidden, device=device, generator=gen) * 1e-5
    cases = {
        "quant_rows": (x, {}),
        "quant_layer_norm": (x, {"layer_norm": ln}),
        "quant_swiglu": (gate_up, {"swiglu": True}),
        "quant_swiglu_dequant": (acc, {"swiglu": True, "dequant": (rs, cs)}),
    }
    for name, (inp, kw) in cases.items():
        for kind, rotation in (("fp8", 0), ("int8", 0), ("int8", 256)):
            ms = bench(lambda: quantize_rows(inp, kind, rotation, **kw), device)
            moved = inp.numel() * inp.element_size() + inp.shape[0] * (inp.shape[1] // (2 if "swiglu" in name else 1))
            q, s = quantize_rows(inp, kind, rotation, **kw)
            qr, sr = quantize_rows_reference(inp, kind, rotation, **kw)
            steps = (q.float() - qr.float()).abs()
            row = dict(what="kernel", kernel=name, fmt=kind, rotation=rotation, ms=round(ms, 4),
                       gbps=round(moved / ms / 1e6, 1), scale_rel_diff=float(f"{((s - sr).abs() / sr).max():.2e}"),
                       q_diff_fraction=float(f"{(steps > 0).float().mean():.2e}"))  # fmt: skip
            if name == "quant_layer_norm":  # the unfused torch ops it replaces: LayerNorm, modulate, quantise
                row["torch_unfused_ms"] = round(bench(lambda: quantize_rows_reference(
                    (F.layer_norm(x, (d,), eps=1e-6) * mod), kind, rotation), device), 4)  # fmt: skip
            emit(**row)
    out_acc = acc[:, :d].contiguous()
    residual = torch.randn(m, d, device=device, generator=gen).to(torch.bfloat16)
    gate = torch.randn(1, d, device=device, generator=gen).to(torch.bfloat16)
    y = torch.randn(m, d, device=device, generator=gen).to(torch.bfloat16)
    rsd, csd = rs, cs[:d].contiguous()
    for name, fn, torch_fn in (
        ("epilogue_dequant", lambda: linear_epilogue(out_acc, row_scale=rsd, col_scale=csd),
         lambda: (out_acc.float() * rsd[:, None] * csd[None, :]).bfloat16()),
        ("epilogue_residual_bf16", lambda: linear_epilogue(y, residual=residual, gate=gate, rows_per_batch=m),
         lambda: residual + gate * y),
        ("epilogue_residual_int32", lambda: linear_epilogue(out_acc, row_scale=rsd, col_scale=csd, residual=residual,
                                                            gate=gate, rows_per_batch=m),
         lambda: residual + gate * (out_acc.float() * rsd[:, None] * csd[None, :]).bfloat16()),
    ):  # fmt: skip
        emit(what="kernel", kernel=name, ms=round(bench(fn, device), 4), torch_ms=round(bench(torch_fn, device), 4))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rows", type=int, default=4096)
    args = parser.parse_args()
    device = torch.device(args.device)
    emit(what="setup", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         torch=torch.__version__)  # fmt: skip
    if args.tiny:
        gemms(64, TINY_SHAPES, device)
        kernels(64, 256, 768, device)
        return
    with torch.inference_mode():
        gemms(args.rows, SHAPES, device)
        kernels(args.rows, 4096, 12288, device)


if __name__ == "__main__":
    main()
