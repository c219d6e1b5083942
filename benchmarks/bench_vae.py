"""VAE decode/encode speed, memory and quality: ours (exact untiled, exact tiled, fast) against diffusers 0.42.1
AutoencoderKLQwenImage21 in ONE process on identical random full-size weights (diffusers' default init),
bf16 unless stated. Prints one JSON line per measurement.

    python benchmarks/bench_vae.py                       # H200: 1024^2 and 2048^2, all measurements
    python benchmarks/bench_vae.py --sizes 1024          # one size
    python benchmarks/bench_vae.py --measure-memory      # bytes/pixel for vae_tiling.BYTES_PER_PIXEL (CUDA)
    python benchmarks/bench_vae.py --meta-memory         # the same, estimated on the meta device (no GPU)
    python benchmarks/bench_vae.py --sweep-kernel        # launch shapes of the fused norm kernel (CUDA)
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
                exact_tiled (512 px tiles), fast, fast_no_cudnn_benchmark.
  precision     PSNR of bf16 / fp16 decodes (exact and fast) against an fp32 decode of the same weights.
  encode        ours vs diffusers: ms, identical, max_abs.
  summary       the issue's targets at this size.
"""

# ruff: noqa: B023  (the timed closures run inside the loop iteration that defines them)
from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from _common import emit, sync
from qwen21_nodes.kernels import bias_residual
from qwen21_nodes.kernels import rmsnorm_silu as norm_kernel
from qwen21_nodes.qwen21_core.config import VAEConfig
from qwen21_nodes.qwen21_core.vae import fast as vae_fast
from qwen21_nodes.qwen21_core.vae import tiling as vae_tiling
from qwen21_nodes.qwen21_core.vae.model import ExactOps, QwenImage21VAE

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


def sweep_kernel(device, iters):
    shapes = [(1, 144, 1024, 1024), (1, 288, 1024, 1024), (1, 576, 512, 512), (1, 1152, 256, 256)]
    saved = (norm_kernel.BLOCK_ELEMENTS, norm_kernel.BLOCK_C_CHANNELS_LAST, norm_kernel.NUM_WARPS)
    try:
        for shape in shapes:
            x = torch.randn(shape, device=device, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
            gamma = torch.ones(shape[1], 1, 1, device=device, dtype=torch.bfloat16)
            scale = shape[1] ** 0.5
            gbytes = 2 * x.numel() * x.element_size() / 1e9
            for variant, fn in (
                ("torch_eager_reference", norm_kernel.rmsnorm_silu_eager_reference),
                ("eager_kernel_with_torch_norm", norm_kernel.rmsnorm_silu_eager_fused),
            ):
                ms, _, _ = measure(lambda: fn(x, gamma, scale, 1e-12, True), device, iters)
                emit(what="norm_kernel", variant=variant, shape=shape, ms=ms)
            for elements in (2048, 4096, 8192):
                for block_c in (32, 64, 128):
                    for warps in (4, 8):
                        norm_kernel.BLOCK_ELEMENTS, norm_kernel.BLOCK_C_CHANNELS_LAST, norm_kernel.NUM_WARPS = (
                            elements, block_c, warps,
                        )  # fmt: skip
                        ms, _, _ = measure(
                            lambda: norm_kernel.rmsnorm_silu_fused(x, gamma, scale, 1e-12), device, iters
                        )
                        emit(what="norm_kernel", variant="fast", shape=shape, block_elements=elements,
                             block_c=block_c, num_warps=warps, ms=ms, gb_per_s=gbytes / ms * 1e3)  # fmt: skip
    finally:
        norm_kernel.BLOCK_ELEMENTS, norm_kernel.BLOCK_C_CHANNELS_LAST, norm_kernel.NUM_WARPS = saved


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
    if args.sweep_kernel:
        sweep_kernel(device, args.iters)
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
