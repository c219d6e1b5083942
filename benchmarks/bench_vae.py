"""VAE decode/encode speed, memory and quality: ours (exact untiled, exact tiled, fast) against diffusers 0.42.1
AutoencoderKLQwenImage21 in ONE process on identical random full-size weights (diffusers' default init),
bf16 unless stated. Prints one JSON line per measurement.

    python benchmarks/bench_vae.py                       # H200: 1024^2 and 2048^2, all measurements
    python benchmarks/bench_vae.py --sizes 1024          # one size
    python benchmarks/bench_vae.py --measure-memory      # bytes/pixel for vae_tiling.BYTES_PER_PIXEL (CUDA)
    python benchmarks/bench_vae.py --meta-memory         # the same, estimated on the meta device (no GPU)
    python benchmarks/bench_vae.py --sweep-kernel        # launch shapes of both norm kernels at the decoder's shapes
    python benchmarks/bench_vae.py --cudnn-benchmark     # fast decode with cudnn.benchmark on vs off (own processes)
    python benchmarks/bench_vae.py --placeholders        # both of the above: what settled the two launch
                                                         # constants (vae/fast.py, kernels/rmsnorm_silu.py)
    python benchmarks/bench_vae.py --profile --sizes 1024  # where the time goes: top kernels, exact and fast
    python benchmarks/bench_vae.py --tiny --device cpu   # smoke test of the script itself

Records ("what" field):
  decode        one line per variant: ms (median), peak_gib (the model's weights + the activation peak of
                the call), ratio to diffusers' untiled time, and for ours: identical (torch.equal with
                diffusers' [-1, 1] output), max_abs, psnr_vs_exact (0..1 images, peak 1).
                Variants: diffusers, diffusers_tiled (its default 256/192 tiles), exact (default path: the
                fused eager norm where its self-test passed), exact_torch (norm in torch only),
                exact_no_epilogue_kernel (conv biases and residual sums by torch's ops, not
                kernels/bias_residual.py), exact_previous (the exact path before norms wrote into padded
                buffers, half-precision norms skipped the fp32 copy and the bias/residual kernel;
                exact_speedup_vs_previous = its time / exact's time),
                exact_tiled (512 px tiles), fast, fast_no_cudnn_benchmark (in the same process after
                "fast", so cuDNN may reuse the algorithms it cached there: --cudnn-benchmark is the clean
                comparison), exact_interruptible (the node's decode: with its 16 interruption points).
  precision     PSNR of bf16 / fp16 decodes (exact and fast) against an fp32 decode of the same weights.
  encode        ours vs diffusers: ms, identical, max_abs.
  summary       the issue's targets at this size.
  cudnn_benchmark          (--cudnn-benchmark) one line per setting and size, each setting in a fresh process
                (cuDNN's algorithm caches start empty): first_call_ms (the first fast decode at that size,
                after a warm-up decode at another size that compiles the kernels), ms (median after it),
                psnr_vs_exact.
  cudnn_benchmark_summary  per size: steady ms on/off, first-call ms on/off, and break_even_decodes (how many
                decodes at one size it takes benchmark mode to win back its first-call search; null if it
                never does).
  norm_kernel_calls        (--sweep-kernel) the norm calls of one decode at --sweep-size, traced on the meta
                device: shape, layout, count, per path (exact: the eager kernel, NCHW; fast: the fused
                kernel, channels-last).
  norm_kernel_launch       one line per kernel, traced shape and launch shape (block_elements, block_c,
                num_warps): ms per call.
  norm_kernel_sweep_summary per kernel: the decode's total norm-kernel time (calls x ms) for the current
                constants and for the best launch shape; plus the best shared BLOCK_ELEMENTS / NUM_WARPS
                (the two kernels share them; each has its own BLOCK_C).
"""

# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections import Counter

import torch
from _common import emit, sync
from qwen21_nodes.kernels import bias_residual
from qwen21_nodes.kernels import rmsnorm_silu as norm_kernel
from qwen21_nodes.qwen21_core.config import VAEConfig
from qwen21_nodes.qwen21_core.vae import fast as vae_fast
from qwen21_nodes.qwen21_core.vae import tiling as vae_tiling
from qwen21_nodes.qwen21_core.vae.model import ExactOps, QwenImage21VAE, zero_bordered_empty

TINY_CONFIG = VAEConfig(
    base_dim=8, decoder_base_dim=12, z_dim=4, dim_mult=(1, 2, 4, 4, 4), latents_mean=(0.0,) * 4,
    latents_std=(1.0,) * 4,
)  # fmt: skip


def measure(fn, device, iters, warmup=1):
    """(median ms, peak GiB of activations of one call, last result). Peak: max_memory_allocated during the
    call minus what was allocated before it (CUDA only, else None)."""
    result = None
    for _ in range(warmup):
        result = fn()
    result = None
    sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - before) / 2**30
        if iters:
            del result
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return (statistics.median(times) if times else None), peak, result


def weights_gib(module):
    return sum(p.numel() * p.element_size() for p in module.parameters()) / 2**30


def psnr(a, b):
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def to_image(pixels):
    """diffusers [-1, 1] NCHW (or NCTHW) -> our 0..1 NHWC float32 convention."""
    if pixels.dim() == 5:
        pixels = pixels[:, :, 0]
    return pixels.float().mul(0.5).add(0.5).clamp(0, 1).permute(0, 2, 3, 1)


class PreviousExactOps(ExactOps):
    """The exact path as it was before this round of work: the norm's own output tensor, then F.pad's copy
    before each 3x3 conv, and the residual sum as a pass of its own. Run with the "direct_norm" and
    bias_residual self-tests forced off for the norm over an fp32 copy and torch's bias adds, as then. Kept
    for the in-process comparison with the current exact path."""

    def norm_conv(self, x, norm, silu, conv, pad=None, residual=None):
        y = self.conv(self.norm(x, norm, silu), conv, pad)
        return y if residual is None else self.add_(y, residual)


def build_models(config, device, dtype, seed=0):
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(seed)
    with torch.device(device):
        ref = AutoencoderKLQwenImage21(**config.to_dict())
    ref = ref.to(dtype).eval().requires_grad_(False)
    ours = QwenImage21VAE(config).to(device)
    ours.load_diffusers_state_dict(ref.state_dict())
    return ref, ours.to(dtype).eval().requires_grad_(False)


def bench_size(ref, ours, res, args, device):
    dtype = ours.dtype
    iters = args.iters if res <= 1024 else max(2, args.iters // 2)
    gen = torch.Generator(device="cpu").manual_seed(res)
    z = torch.randn(1, ours.config.z_dim, res // 16, res // 16, generator=gen).to(device, dtype)
    z5 = z[:, :, None]
    common = dict(res=res, dtype=str(dtype).replace("torch.", ""), device=str(device))
    ref_w, our_w = weights_gib(ref), weights_gib(ours)

    with torch.no_grad():
        ms_ref, peak, ref_pixels = measure(lambda: ref.decode(z5).sample, device, iters)
    ref_pixels = ref_pixels[:, :, 0]
    emit(what="decode", variant="diffusers", ms=ms_ref, peak_gib=_add(peak, ref_w), **common)
    clamped = (ref_pixels.abs() >= 1).float().mean().item()

    if res <= args.max_diffusers_tiled:
        ref.enable_tiling()
        with torch.no_grad():
            ms, peak, _ = measure(lambda: ref.decode(z5).sample, device, max(2, iters // 2))
        ref.disable_tiling()
        emit(what="decode", variant="diffusers_tiled", ms=ms, peak_gib=_add(peak, ref_w), ratio=ms / ms_ref, **common)

    def ours_record(variant, fn, exact_pixels=None, compare_to_ref=True):
        ms, peak, images = measure(fn, device, iters)
        fields = dict(variant=variant, ms=ms, peak_gib=_add(peak, our_w), ratio=ms / ms_ref)
        if compare_to_ref:
            pixels = ours.decode_pixels(z, ours.ops_for("fast" if variant.startswith("fast") else "exact"))
            if variant.startswith("exact") and "tiled" not in variant:
                fields.update(
                    identical=torch.equal(pixels, ref_pixels), max_abs=(pixels - ref_pixels).abs().max().item()
                )
        if exact_pixels is not None:
            fields.update(psnr_vs_exact=psnr(images, exact_pixels))
        emit(what="decode", info=dict(ours.last_decode_info), **fields, **common)
        return ms, peak, images

    on_cuda = device.type == "cuda"
    verified = norm_kernel.eager_kernel_verified(device, dtype) if on_cuda else False
    direct = norm_kernel.direct_norm_verified(device, dtype) if on_cuda and dtype != torch.float32 else False
    epilogue = bias_residual.epilogue_verified(device, dtype) if on_cuda else False
    emit(what="self_tests", eager_norm_kernel=verified, direct_half_norm=direct, bias_residual=epilogue, **common)
    ms_exact, peak_exact, exact = ours_record("exact", lambda: ours.decode(z, tiling="off"))

    with norm_kernel.SELF_TESTS.forced("eager_kernel", device, dtype, False):  # the norm in torch only
        ours_record("exact_torch", lambda: ours.decode(z, tiling="off"))

    with bias_residual.SELF_TESTS.forced("epilogue", device, dtype, False):  # conv biases and residual sums by torch
        ms, _, pixels = measure(lambda: ours.decode_pixels(z), device, iters)
    emit(what="decode", variant="exact_no_epilogue_kernel", ms=ms, ratio=ms / ms_ref,
         exact_speedup_vs_this=ms / ms_exact, identical=torch.equal(pixels, ref_pixels), **common)  # fmt: skip
    del pixels

    previous = PreviousExactOps()
    with (
        norm_kernel.SELF_TESTS.forced("direct_norm", device, dtype, False),
        bias_residual.SELF_TESTS.forced("epilogue", device, dtype, False),
        torch.no_grad(),
    ):
        ms, peak, pixels = measure(lambda: ours.decode_pixels(z, previous), device, iters)
    emit(what="decode", variant="exact_previous", ms=ms, peak_gib=_add(peak, our_w), ratio=ms / ms_ref,
         exact_speedup_vs_previous=ms / ms_exact, identical=torch.equal(pixels, ref_pixels), **common)  # fmt: skip
    del pixels

    ms, _, _ = measure(lambda: ours.decode(z, tiling="off", check_interrupt=lambda: None), device, iters)
    emit(what="decode", variant="exact_interruptible", ms=ms, ratio=ms / ms_ref, cost_vs_exact=ms / ms_exact - 1,
         **common)  # fmt: skip

    ours_record("exact_tiled", lambda: ours.decode(z, tiling="on", tile_size=args.tile), exact, compare_to_ref=False)
    ms_fast, peak_fast, _ = ours_record("fast", lambda: ours.decode(z, tiling="off", quality="fast"), exact)
    saved_benchmark = vae_fast.CUDNN_BENCHMARK
    vae_fast.CUDNN_BENCHMARK = False
    try:
        ours_record("fast_no_cudnn_benchmark", lambda: ours.decode(z, tiling="off", quality="fast"), exact)
    finally:
        vae_fast.CUDNN_BENCHMARK = saved_benchmark

    if res <= args.max_precision:
        full = ours.decode(z, tiling="off", precision="fp32")
        for precision in ("bf16", "fp16"):
            for quality in ("exact", "fast"):
                images = ours.decode(z, tiling="off", precision=precision, quality=quality)
                emit(what="precision", precision=precision, quality=quality, psnr_vs_fp32=psnr(images, full),
                     finite=bool(torch.isfinite(images).all()), **common)  # fmt: skip
        del full

    images = to_image(torch.rand(1, 4, res, res, generator=gen)).to(device)  # 0..1 NHWC
    pixels = (2.0 * images.permute(0, 3, 1, 2) - 1.0).to(dtype).contiguous()[:, :, None]
    with torch.no_grad():
        ms_enc_ref, _, ref_latents = measure(lambda: ref.encode(pixels).latent_dist.mode(), device, iters)
        ms_enc, peak_enc, latents = measure(lambda: ours.encode(images, tiling="off"), device, iters)
    ref_latents = ref_latents[:, :, 0]
    max_abs = (latents - ref_latents).abs().max().item()
    emit(what="encode", ms=ms_enc, ms_diffusers=ms_enc_ref, ratio=ms_enc / ms_enc_ref, peak_gib=_add(peak_enc, our_w),
         identical=torch.equal(latents, ref_latents), max_abs=max_abs, **common)  # fmt: skip

    emit(
        what="summary",
        exact_ratio=ms_exact / ms_ref,
        exact_ratio_target=0.75,
        exact_peak_gib=_add(peak_exact, our_w),
        exact_peak_target_gib=4.0 if res == 1024 else None,
        fast_ratio=ms_fast / ms_ref,
        fast_ratio_target=0.5,
        fast_peak_gib=_add(peak_fast, our_w),
        clamped_fraction=clamped,
        **common,
    )


def _add(peak, weights):
    return None if peak is None else peak + weights


# ---------------------------------------------------------------------------------------------------------
# Memory constants
# ---------------------------------------------------------------------------------------------------------


def measure_memory(ours, device, sizes):
    """Slope of the activation peak (bytes per pixel) between the smallest and largest size, untiled."""
    for dtype in (torch.bfloat16, torch.float32):
        vae = ours.to(dtype)
        for kind, quality in (("decode", "exact"), ("decode", "fast"), ("encode", "exact")):
            peaks = []
            for res in sizes:
                if kind == "decode":
                    z = torch.randn(1, vae.config.z_dim, res // 16, res // 16, device=device, dtype=dtype)
                    _, peak, _ = measure(lambda: vae.decode(z, tiling="off", quality=quality), device, iters=0)
                else:
                    images = torch.rand(1, res, res, 4, device=device)
                    _, peak, _ = measure(lambda: vae.encode(images, tiling="off"), device, iters=0)
                peaks.append(peak * 2**30)
            slope = (peaks[-1] - peaks[0]) / (sizes[-1] ** 2 - sizes[0] ** 2)
            element = torch.empty((), dtype=dtype).element_size()
            emit(what="bytes_per_pixel", kind=kind, quality=quality, element_bytes=element, measured=round(slope),
                 suggested=round(slope * 1.1), current=vae_tiling.BYTES_PER_PIXEL[(kind, quality, element)],
                 peaks_gib=[p / 2**30 for p in peaks], sizes=sizes)  # fmt: skip
    ours.to(torch.bfloat16)


def meta_memory(sizes):
    """bytes/pixel from live-tensor tracking on the meta device (the fused norm kernels stand in as a single
    output allocation, which is what they allocate)."""
    with torch.device("meta"):
        vae = QwenImage21VAE()
    saved = norm_kernel.unsupported_reason, norm_kernel.rmsnorm_silu_fused
    for dtype in (torch.bfloat16, torch.float32):
        vae = vae.to(dtype)
        for kind, quality in (("decode", "exact"), ("decode", "fast"), ("encode", "exact")):
            peaks = []
            for res in sizes:
                if quality == "fast":  # the fused kernel allocates its output only
                    norm_kernel.unsupported_reason = lambda x, gamma: None
                    norm_kernel.rmsnorm_silu_fused = lambda x, *a, **k: torch.empty_like(x)
                z = torch.empty(1, 64, res // 16, res // 16, device="meta", dtype=dtype)
                pixels = torch.empty(1, 4, res, res, device="meta", dtype=dtype)
                try:
                    if kind == "decode":
                        peaks.append(vae_tiling.live_tensor_peak(lambda: vae.decode_pixels(z, vae.ops_for(quality))))
                    else:
                        peaks.append(vae_tiling.live_tensor_peak(lambda: vae.encode_pixels(pixels)))
                finally:
                    norm_kernel.unsupported_reason, norm_kernel.rmsnorm_silu_fused = saved
            slope = (peaks[-1] - peaks[0]) / (sizes[-1] ** 2 - sizes[0] ** 2)
            emit(what="meta_bytes_per_pixel", kind=kind, quality=quality, dtype=str(dtype), slope=round(slope),
                 peaks_gib=[p / 2**30 for p in peaks], sizes=sizes)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Kernel launch shapes
# ---------------------------------------------------------------------------------------------------------


def decoder_norm_calls(config, res, quality) -> Counter:
    """(shape, silu, into_padded) -> calls, for the channel norms of one bf16 decode at res x res, traced on the
    meta device (where the fast path's fused kernel falls back to the same entry point). Layouts are not traced
    (meta convolutions do not keep channels-last): exact activations are NCHW, fast ones channels-last."""
    with torch.device("meta"):
        vae = QwenImage21VAE(config)
    vae = vae.to(torch.bfloat16)
    calls = Counter()
    traced = norm_kernel.rmsnorm_silu_eager

    def record(x, gamma, scale, eps, silu, out=None):
        calls[(tuple(x.shape), silu, out is not None)] += 1
        return traced(x, gamma, scale, eps, silu, out=out)

    norm_kernel.rmsnorm_silu_eager = record
    try:
        z = torch.empty(1, config.z_dim, res // 16, res // 16, device="meta", dtype=torch.bfloat16)
        vae.decode_pixels(z, vae.ops_for(quality))
    finally:
        norm_kernel.rmsnorm_silu_eager = traced
    return calls


def kernel_ms(fn, device, iters, reps):
    """Median ms per call of fn, each sample averaging `reps` back-to-back calls (CUDA events on the GPU)."""
    fn()  # compile / warm up
    sync(device)
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / reps)
        else:
            began = time.perf_counter()
            for _ in range(reps):
                fn()
            samples.append((time.perf_counter() - began) * 1e3 / reps)
    return statistics.median(samples)


_LAUNCH = ("BLOCK_ELEMENTS", "BLOCK_C_NCHW", "BLOCK_C_CHANNELS_LAST", "NUM_WARPS")


def _norm_launch(kernel, x, gamma, scale, silu, norm, out):
    """One call of the kernel the exact path ("eager": the norm from torch, into `out` if given) or the fast
    path ("fused") makes for x."""
    if kernel == "eager":
        return lambda: norm_kernel.rmsnorm_silu_eager_fused(x, gamma, scale, 1e-12, silu, norm, out)
    return lambda: norm_kernel.rmsnorm_silu_fused(x, gamma, scale, 1e-12, silu)


def sweep_kernel(config, device, args):
    """Time both norm kernels at every launch shape of the grid, at the shapes one decode uses; emit the
    decode's total per launch shape and the best ones (see the module docstring)."""
    if not norm_kernel.TRITON_AVAILABLE or norm_kernel.unsupported_reason(
        torch.empty(1, 1, 1, 1, device=device), torch.empty(1, device=device)
    ):
        emit(what="norm_kernel_sweep_summary", skipped=f"the Triton kernels cannot run on {device} here")
        return
    saved = {name: getattr(norm_kernel, name) for name in _LAUNCH}
    grid = [(e, c, w) for e in args.sweep_elements for c in args.sweep_block_c for w in args.sweep_warps]
    current = {"eager": (saved["BLOCK_ELEMENTS"], saved["BLOCK_C_NCHW"], saved["NUM_WARPS"]),
               "fused": (saved["BLOCK_ELEMENTS"], saved["BLOCK_C_CHANNELS_LAST"], saved["NUM_WARPS"])}  # fmt: skip
    if current["eager"] not in grid or current["fused"] not in grid:
        grid += [current["eager"], current["fused"]]
    # the exact path's eager kernel (norm from torch; NCHW) and the fast path's fused kernel (channels-last)
    paths = {"eager": ("exact", torch.contiguous_format), "fused": ("fast", torch.channels_last)}
    totals = {kernel: Counter() for kernel in paths}
    try:
        for kernel, (quality, layout) in paths.items():
            for (shape, silu, padded), count in sorted(decoder_norm_calls(config, args.sweep_size, quality).items()):
                emit(what="norm_kernel_calls", kernel=kernel, shape=shape, layout=str(layout), silu=silu,
                     into_padded=padded, calls=count, res=args.sweep_size, swept=silu)  # fmt: skip
                if not silu:
                    continue  # the attention norm, once per decode: not worth a second set of compiles
                x = torch.randn(shape, device=device, dtype=torch.bfloat16).contiguous(memory_format=layout)
                gamma = torch.rand(shape[1], 1, 1, device=device, dtype=torch.bfloat16) + 0.5
                scale = shape[1] ** 0.5
                out = zero_bordered_empty(x, (1, 1, 1, 1))[1] if padded else None
                norm = norm_kernel.channel_norm(x, 1e-12)
                for elements, block_c, warps in dict.fromkeys(grid):
                    norm_kernel.BLOCK_ELEMENTS, norm_kernel.NUM_WARPS = elements, warps
                    norm_kernel.BLOCK_C_NCHW = norm_kernel.BLOCK_C_CHANNELS_LAST = block_c
                    fn = _norm_launch(kernel, x, gamma, scale, silu, norm, out)
                    ms = kernel_ms(fn, device, args.iters, args.kernel_reps)
                    totals[kernel][(elements, block_c, warps)] += ms * count
                    emit(what="norm_kernel_launch", kernel=kernel, shape=shape, silu=silu,
                         block_elements=elements, block_c=block_c, num_warps=warps, ms=ms)  # fmt: skip
    finally:
        for name, value in saved.items():
            setattr(norm_kernel, name, value)
    best = {kernel: min(total, key=total.get) for kernel, total in totals.items()}
    names = ("block_elements", "block_c", "num_warps")
    for kernel, total in totals.items():
        now, top = total[current[kernel]], total[best[kernel]]
        emit(
            what="norm_kernel_sweep_summary",
            kernel=kernel,
            res=args.sweep_size,
            current=dict(zip(names, current[kernel], strict=True)),
            current_total_ms=now,
            best=dict(zip(names, best[kernel], strict=True)),
            best_total_ms=top,
            current_vs_best=now / top,
        )

    # BLOCK_ELEMENTS and NUM_WARPS are shared by the two kernels (each has its own BLOCK_C): the pair that
    # loses least against each kernel's best, summed over both
    def best_block_c(total, elements, warps):
        options = {c: ms for (e, c, w), ms in total.items() if (e, w) == (elements, warps)}
        return min(options, key=options.get)

    def shared_cost(pair):
        return sum(
            total[(pair[0], best_block_c(total, *pair), pair[1])] / total[best[k]] for k, total in totals.items()
        )

    elements, warps = min(sorted({(e, w) for e, _, w in grid}), key=shared_cost)
    emit(what="norm_kernel_sweep_summary", kernel="shared", res=args.sweep_size, BLOCK_ELEMENTS=elements,
         NUM_WARPS=warps, BLOCK_C_NCHW=best_block_c(totals["eager"], elements, warps),
         BLOCK_C_CHANNELS_LAST=best_block_c(totals["fused"], elements, warps),
         loss_vs_each_best=shared_cost((elements, warps)) / len(totals) - 1)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# cuDNN benchmark mode of the fast path
# ---------------------------------------------------------------------------------------------------------


def cudnn_benchmark_child(config, device, sizes, iters, enabled: bool):
    """In a fresh process: the fast decode with vae_fast.CUDNN_BENCHMARK = enabled, first call and steady state
    at each size (after a warm-up decode at a size not measured, which compiles the Triton kernels)."""
    vae_fast.CUDNN_BENCHMARK = enabled
    torch.manual_seed(0)
    ours = QwenImage21VAE(config).to(device, torch.bfloat16).eval().requires_grad_(False)
    warm = torch.randn(1, config.z_dim, 8, 8, device=device, dtype=torch.bfloat16)
    ours.decode(warm, tiling="off", quality="fast")
    sync(device)
    for res in sizes:
        z = torch.randn(1, config.z_dim, res // 16, res // 16, generator=torch.Generator().manual_seed(res))
        z = z.to(device, torch.bfloat16)
        sync(device)
        began = time.perf_counter()
        fast = ours.decode(z, tiling="off", quality="fast")
        sync(device)
        first = (time.perf_counter() - began) * 1e3
        ms, _, _ = measure(lambda: ours.decode(z, tiling="off", quality="fast"), device, iters, warmup=0)
        exact = ours.decode(z, tiling="off")  # after the fast calls: its algorithm choices cannot serve them
        emit(what="cudnn_benchmark", cudnn_benchmark=enabled, res=res, first_call_ms=first, ms=ms,
             psnr_vs_exact=psnr(fast, exact), device=str(device))  # fmt: skip
        del fast, exact


def cudnn_benchmark_compare(args, sizes):
    """Run cudnn_benchmark_child for on and off, each in its own process, and summarise per size."""
    records = {}
    for enabled in (True, False):
        command = [
            sys.executable,
            __file__,
            "--cudnn-child",
            "on" if enabled else "off",
            "--device",
            args.device,
            "--iters",
            str(args.iters),
            "--sizes",
            *map(str, sizes),
            *(["--tiny"] if args.tiny else []),
        ]
        child = subprocess.run(command, capture_output=True, text=True, timeout=args.child_timeout)
        if child.returncode != 0:
            emit(what="cudnn_benchmark", cudnn_benchmark=enabled, error=child.stderr.strip().splitlines()[-1:])
            return
        for line in child.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                sys.stdout.write(line + "\n")
                records[(enabled, record["res"])] = record
    for res in sizes:
        on, off = records[(True, res)], records[(False, res)]
        gain = off["ms"] - on["ms"]  # per steady decode
        penalty = on["first_call_ms"] - off["first_call_ms"]
        break_even = None if gain <= 0 else max(0.0, penalty / gain)
        emit(what="cudnn_benchmark_summary", res=res, on_ms=on["ms"], off_ms=off["ms"],
             on_first_call_ms=on["first_call_ms"], off_first_call_ms=off["first_call_ms"],
             break_even_decodes=break_even, psnr_on=on["psnr_vs_exact"], psnr_off=off["psnr_vs_exact"])  # fmt: skip


def profile(ours, res, device):
    """Top CUDA kernels of one untiled exact and one fast decode (after a warm-up)."""
    z = torch.randn(1, ours.config.z_dim, res // 16, res // 16, device=device, dtype=ours.dtype)
    for quality in ("exact", "fast"):
        ours.decode(z, tiling="off", quality=quality)
        sync(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            ours.decode(z, tiling="off", quality=quality)
            sync(device)
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.self_device_time_total for e in events) / 1e3
        events.sort(key=lambda e: e.self_device_time_total, reverse=True)
        for e in events[:25]:
            emit(what="profile", quality=quality, res=res, kernel=e.key[:120], calls=e.count,
                 ms=e.self_device_time_total / 1e3, share=e.self_device_time_total / 1e3 / total)  # fmt: skip
        emit(what="profile_total", quality=quality, res=res, ms=total)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="output sides in px (default 1024 2048)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny random VAE (smoke test)")
    parser.add_argument("--iters", type=int, default=6, help="timed runs per measurement (halved above 1024)")
    parser.add_argument("--tile", type=int, default=512, help="tile size in px of the exact_tiled variant")
    parser.add_argument("--max-diffusers-tiled", type=int, default=1024, help="largest size for diffusers tiled")
    parser.add_argument("--max-precision", type=int, default=1024, help="largest size for the precision lines")
    parser.add_argument("--measure-memory", action="store_true")
    parser.add_argument("--meta-memory", action="store_true")
    parser.add_argument("--sweep-kernel", action="store_true")
    parser.add_argument("--sweep-size", type=int, default=None, help="output side of the traced decode (1024)")
    parser.add_argument("--sweep-elements", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--sweep-block-c", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--sweep-warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--kernel-reps", type=int, default=10, help="calls per timing sample in the sweep")
    parser.add_argument("--cudnn-benchmark", action="store_true", help="fast decode, benchmark mode on vs off")
    parser.add_argument("--cudnn-child", choices=("on", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--child-timeout", type=int, default=300)
    parser.add_argument("--placeholders", action="store_true", help="--cudnn-benchmark and --sweep-kernel")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    if args.meta_memory:
        meta_memory(args.sizes or [512, 1024])
        return
    device = torch.device(args.device)
    config = TINY_CONFIG if args.tiny else VAEConfig()
    sizes = args.sizes or ([64] if args.tiny else [1024, 2048])
    if args.tiny:
        args.tile = min(args.tile, 32)
        args.max_diffusers_tiled = args.max_precision = max(sizes)
    if args.cudnn_child:
        cudnn_benchmark_child(config, device, sizes, args.iters, args.cudnn_child == "on")
        return
    if args.cudnn_benchmark or args.placeholders:
        cudnn_benchmark_compare(args, sizes)
    if args.sweep_kernel or args.placeholders:
        args.sweep_size = args.sweep_size or (sizes[0] if args.tiny else 1024)
        sweep_kernel(config, device, args)
    if args.cudnn_benchmark or args.sweep_kernel or args.placeholders:
        return
    ref, ours = build_models(config, device, torch.bfloat16)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    params_m = sum(p.numel() for p in ours.parameters()) / 1e6
    emit(what="setup", device=str(device), gpu=gpu, torch=torch.__version__, tiny=args.tiny, vae_params_m=params_m)
    if args.profile:
        del ref
        for res in sizes:
            profile(ours, res, device)
        return
    if args.measure_memory:
        del ref
        measure_memory(ours, device, sorted(sizes if len(sizes) > 1 else [sizes[0] // 2, sizes[0]]))
        return
    for res in sizes:
        bench_size(ref, ours, res, args, device)


if __name__ == "__main__":
    main()
