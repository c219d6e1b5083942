"""GGUF DiT layers (quant/gguf_linear.py) against our bf16 and fp8 DiT, in one process, full size, random weights.

    python benchmarks/bench_gguf.py                         # H200: 1024^2, Q8_0 and Q4_K against bf16 and fp8
    python benchmarks/bench_gguf.py --types Q8_0,Q4_K,Q6_K --steps 20
    python benchmarks/bench_gguf.py --eager --prefetch      # eager steps, each GGUF type also with the prefetch
    python benchmarks/bench_gguf.py --tiny --device cpu     # smoke test

Each variant shares the bf16 model's non-block weights; its block Linears are GGUF layers of random blocks (random
codes with the random init's spread: the speed is what is measured, not the picture), fp8 ones quantised from the
bf16 weights. A run samples --steps steps of a 1024x1024 text-to-image request through our sampler (prefix cache and
decode graphs on); the line gives each variant's median step (the prefix step left out), its ratio to bf16's and to
fp8's, its block weights' bytes and the run's peak VRAM. --eager: decode graphs off (a changed prompt's steps at
1024^2 run eagerly). --prefetch: each GGUF variant also with QWEN21_GGUF_PREFETCH on, in the same process
(`prefetch_speedup`: the plain step over it; `prefetch_identical`: the same latents bit for bit). --kernel-only
times one layer's dequantisation against its GEMM per type (the K-quants also against their first, flat kernel:
`tiled_over_flat`).
"""

from __future__ import annotations

import argparse
import os
import time
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import emit, mean_call_ms, random_dit, sync  # noqa: E402

GIB = 2**30


# Where each type keeps its fp16 scale d (and its fp16 minimum m where it has one), and the spread of its quant codes
# q: a value is d * q for the types without m (their codes centred by the kernel), d * q + m (m = -q_centre * d) for
# those with it.
_SCALES = {
    "Q8_0": dict(d=0, m=None, q_std=73.9, q_centre=0.0),  # int8 codes, -128..127
    "Q4_0": dict(d=0, m=None, q_std=4.61, q_centre=0.0),  # the kernel subtracts 8 itself
    "Q5_0": dict(d=0, m=None, q_std=9.23, q_centre=0.0),  # the kernel subtracts 16 itself
    "Q4_1": dict(d=0, m=2, q_std=4.61, q_centre=7.5),
    "Q5_1": dict(d=0, m=2, q_std=9.23, q_centre=15.5),
}
# K-quants: every sub-block scale (and minimum) code set to 32 (Q4_K, Q5_K: 6-bit codes packed into 12 bytes) or
# 16 (Q6_K: int8 codes), so the fp16 d (and dmin) alone set the spread.
_K_SCALES = {
    "Q4_K": dict(d=0, m=2, codes=(4, bytes([160] * 8 + [0] * 4)), code=32, q_std=4.61, q_centre=7.5),
    "Q5_K": dict(d=0, m=2, codes=(4, bytes([160] * 8 + [0] * 4)), code=32, q_std=9.23, q_centre=15.5),
    "Q6_K": dict(d=208, m=None, codes=(192, bytes([16] * 16)), code=16, q_std=18.47, q_centre=0.0),
}


def random_gguf_rows(qtype: str, rows: int, columns: int, std: float, device, generator=None) -> torch.Tensor:
    """[rows, row bytes] uint8: random `qtype` blocks whose values have spread `std` and are centred on 0 (Q4_0 and
    Q5_0 half a code off: they have no minimum to centre with), from uniform random codes under fixed scales. Full
    size on a GPU in a moment, where a real quantiser would take minutes; the benchmarks time the layers, so the
    values need only be finite and of a realistic size."""
    from qwen21_nodes.kernels.dequantize_gguf import BLOCKS, row_bytes

    block_bytes_ = BLOCKS[qtype][1]
    data = torch.randint(0, 256, (rows, row_bytes(qtype, columns)), dtype=torch.uint8, device=device,
                         generator=generator)  # fmt: skip
    blocks = data.view(-1, block_bytes_)
    layout = _K_SCALES.get(qtype) or _SCALES[qtype]
    d = std / (layout.get("code", 1) * layout["q_std"])
    minimum = layout["q_centre"] * d * (1 if "codes" in layout else -1)  # K-quants subtract their dmin, Q4_1 adds m
    fields = [(layout["d"], d)] + ([(layout["m"], minimum)] if layout["m"] is not None else [])
    for offset, value in fields:
        half = torch.tensor([value], dtype=torch.float16).view(torch.uint8).to(device)
        blocks[:, offset : offset + 2] = half
    if "codes" in layout:
        offset, codes = layout["codes"]
        blocks[:, offset : offset + len(codes)] = torch.tensor(list(codes), dtype=torch.uint8, device=device)
    return data


def gguf_twin(source, qtype: str):
    """A DiT sharing `source`'s tensors whose block Linears are GGUFLinears of random `qtype` blocks with the spread
    of the benchmarks' random init (std 1/sqrt(3 fan_in))."""
    from qwen21_nodes.qwen21_core.quant.gguf_linear import GGUFLinear

    twin = source.shared_twin()
    device = source.device
    gen = torch.Generator(device=device).manual_seed(1)
    for block, original in zip(twin.transformer_blocks, source.transformer_blocks, strict=True):
        for path, linear in original.linears().items():
            layer = GGUFLinear(linear.in_features, ((linear.out_features, qtype),), compute_dtype=source.dtype)
            blocks = random_gguf_rows(qtype, linear.out_features, linear.in_features,
                                      (3 * linear.in_features) ** -0.5, device, gen)  # fmt: skip
            layer.qweight = torch.nn.Parameter(blocks.view(layer.qweight.shape), requires_grad=False)
            parent, _, child = path.rpartition(".")
            setattr(block.get_submodule(parent), child, layer)
    return twin.eval()


def block_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for b in model.transformer_blocks for p in b.parameters())


def step_ms(model, args, device) -> tuple[float, float, str, torch.Tensor]:
    from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
    from qwen21_nodes.qwen21_core.config import SchedulerConfig
    from qwen21_nodes.qwen21_core.options import SampleOptions
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline
    from qwen21_nodes.qwen21_core.request import SampleRequest

    vae = torch.nn.Module()
    vae.anchor = torch.nn.Parameter(torch.zeros(1, device=device), requires_grad=False)
    vae.config = SimpleNamespace(latents_mean=[0.0] * 64, latents_std=[1.0] * 64)
    pipe = Qwen21Pipeline(model, vae, None, SchedulerConfig())
    embeds = torch.randn(40, model.config.context_in_dim, generator=torch.Generator().manual_seed(0))
    cond = Conditioning(PromptEmbedding(embeds, torch.zeros(40, dtype=torch.bool)), content_hash="bench-gguf")
    times, last = [], [0.0]

    def callback(step, total, x0):
        sync(device)
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    for repeat in range(args.repeats + 1):  # the first run compiles and captures
        times.clear()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        sync(device)
        last[0] = time.perf_counter()
        latents = pipe.sample_request(cond, SampleRequest(height=args.size, width=args.size, steps=args.steps,
                                                          seed=repeat, callback=callback),
                                      SampleOptions(decode_graphs=not args.eager))  # fmt: skip
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    steps = sorted(times[1:])
    return 1000 * steps[len(steps) // 2], peak, str(pipe.last_sample_stats.get("decode_graph"))[:60], latents


def kernel_only(args, device) -> None:
    """One gate_up-sized layer: the dequantisation alone and its GEMM on 4096 rows, per type; for the K-quants also
    their first (flat) kernel on the same blocks, its output compared bit for bit."""
    from qwen21_nodes.kernels.dequantize_gguf import BLOCKS, dequantize_gguf
    from qwen21_nodes.qwen21_core.quant.gguf_linear import GGUFLinear

    out_features, in_features = (24576, 4096) if not args.tiny else (768, 256)
    x = torch.randn(4096, in_features, device=device, dtype=torch.bfloat16)
    for qtype in args.types.split(","):
        layer = GGUFLinear(in_features, ((out_features, qtype),)).to(device)
        layer.qweight.data = torch.randint(0, 256, layer.qweight.shape, dtype=torch.uint8, device=device)
        weight = layer.dequantized_weight(torch.bfloat16)
        dequant = mean_call_ms(lambda layer=layer: layer.dequantized_weight(torch.bfloat16), device, 20, warmup=3)
        gemm = mean_call_ms(lambda weight=weight: torch.nn.functional.linear(x, weight), device, 20, warmup=3)
        moved = layer.qweight.numel() + weight.numel() * 2
        row = dict(what="gguf_dequant_kernel", qtype=qtype, shape=[out_features, in_features])
        row.update(dequant_ms=round(dequant, 3), gemm_4096_ms=round(gemm, 3), gb_per_s=round(moved / dequant / 1e6, 1))
        if BLOCKS[qtype][0] == 256:
            data = layer.qweight.data
            flat = mean_call_ms(lambda data=data, q=qtype: dequantize_gguf(data, q, in_features, tiled=False), device,
                                20, warmup=3)  # fmt: skip
            same = torch.equal(dequantize_gguf(data, qtype, in_features, tiled=False).view(torch.int16),
                               weight.view(torch.int16))  # fmt: skip
            row.update(flat_dequant_ms=round(flat, 3), tiled_over_flat=round(dequant / flat, 3), bit_identical=same)
        emit(**row)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--types", default="Q8_0,Q4_K")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kernel-only", action="store_true")
    parser.add_argument("--eager", action="store_true", help="decode graphs off: every step eager, as a changed "
                        "prompt's steps at 1024^2 run")  # fmt: skip
    parser.add_argument("--prefetch", action="store_true",
                        help="each GGUF variant again with QWEN21_GGUF_PREFETCH on (the next layer dequantised on a "
                        "second stream): prefetch_speedup, prefetch_identical")  # fmt: skip
    args = parser.parse_args()
    device = torch.device(args.device)
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    if args.tiny:
        config = TransformerConfig(num_layers=2, num_attention_heads=2, context_in_dim=256)
        args.size = min(args.size, 128)
    else:
        config = TransformerConfig()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with torch.inference_mode():
        if args.kernel_only:
            kernel_only(args, device)
            return
        bf16 = random_dit(config, device, dtype)
        variants = {"bf16": bf16}
        if device.type == "cuda":
            variants["fp8"] = bf16.quantized_copy(uniform_plan(FORMATS["fp8"], config.num_layers))
        for qtype in args.types.split(","):
            variants[qtype] = gguf_twin(bf16, qtype)
        rows = {}
        for name, model in variants.items():
            ms, peak, graphs, latents = step_ms(model, args, device)
            rows[name] = dict(step_ms=round(ms, 2), peak_gib=round(peak, 2),
                              block_gib=round(block_bytes(model) / GIB, 2), decode_graph=graphs)  # fmt: skip
            if args.prefetch and name in args.types.split(","):  # the same run, the next layer dequantised ahead
                from qwen21_nodes.qwen21_core import settings

                before = settings.replace(gguf_prefetch=True)
                try:
                    ms_ahead, peak_ahead, _, ahead = step_ms(model, args, device)
                finally:
                    settings.use(before)
                rows[name].update(prefetch_step_ms=round(ms_ahead, 2), prefetch_peak_gib=round(peak_ahead, 2),
                                  prefetch_speedup=round(ms / ms_ahead, 3),
                                  prefetch_identical=bool(torch.equal(ahead, latents)))  # fmt: skip
        base, fp8 = rows["bf16"]["step_ms"], rows.get("fp8", {}).get("step_ms")
        for name, row in rows.items():
            emit(what="gguf_step", variant=name, size=args.size, steps=args.steps, **row,
                 vs_bf16=round(row["step_ms"] / base, 3), vs_fp8=round(row["step_ms"] / fp8, 3) if fp8 else None,
                 device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")  # fmt: skip


if __name__ == "__main__":
    main()
