"""Channel RMS norm (+ gamma) (+ SiLU) of the VAE: y = silu(x / max(||x||_2 over C, eps) * scale * gamma).

x is [B, C, H, W] in NCHW or channels-last layout; the norm runs over C at every pixel. The VAE's norm is
diffusers' `QwenImage21RMS_norm` (F.normalize in fp32, cast, `* sqrt(C) * gamma`) followed by SiLU. Two
flavours of the op, each with its torch reference beside its Triton kernel:

* `rmsnorm_silu_fused` (quality="fast"): one kernel reads x, sums squares in fp32 over the channels, and
  writes silu(x * scale / max(norm, eps) * gamma) with ONE rounding to x's dtype. Two reads and one write
  of x, against the reference's nine passes; more accurate than the reference in half precision, not
  identical. Its reference is `rmsnorm_silu_reference`; callers check `unsupported_reason` first and use
  their own fallback (the VAE's fast path falls back to the exact norm).
* `rmsnorm_silu_eager` (quality="exact"): the reference's roundings, step for step: q = x / norm in fp32,
  rounded to x's dtype; q * scale, rounded; q * gamma, rounded; SiLU in fp32, rounded. The norm itself comes
  from torch (`channel_norm`: `linalg.vector_norm` as F.normalize computes it), because its summation order
  belongs to torch's reduction kernel; on CUDA it reduces half-precision x straight into fp32 instead of
  over an fp32 copy, once `direct_norm_verified` has shown the sums equal. The kernel fuses the rest into
  one pass and can write into any strided view (`out`), e.g. the interior of the zero-padded buffer the
  next conv reads, which saves the VAE the padded copy. It is compiled without fp contraction and without
  flush-to-zero, so every divide (div_rn), multiply and cast rounds as torch's separate kernels do; the one
  library call is exp in SiLU (libdevice expf). The VAE's exact mode uses the kernel only after
  `eager_kernel_verified` has compared it with torch on the device: SiLU over EVERY value of the dtype (all
  2^16 half-precision values; all 2^32 fp32 values) and the whole chain on random and extreme inputs, into
  plain and padded outputs. Elsewhere the torch reference runs, which is itself leaner than the reference's
  code (the divide writes x's dtype directly; scale, gamma and SiLU run in place; no `+ 0.0`).

Dispatch (`rmsnorm_silu_eager`, `unsupported_reason`): the kernels run on CUDA tensors when Triton is
installed (and on CPU tensors under TRITON_INTERPRET=1, for tests); everything else takes torch.
Unsupported layouts (H and W not mergeable into one strided axis) and dtypes also fall back.
"""

from __future__ import annotations

import torch

from ._triton import (
    INTERPRETER_ACTIVE,
    TRITON_AVAILABLE,
    SelfTests,
    cdiv,
    jit,
    next_power_of_2,
    pixel_strides,
    same_bits,
    tl,
    triton_runs_on,
)
from .launch import launch

if TRITON_AVAILABLE:
    from triton.language.extra import libdevice
else:
    libdevice = None


# Launch shape: channels x pixels per tile (power-of-two sides). Near the best shape bench_vae.py --placeholders
# found for the exact path's eager kernel, a little behind it for the fused one; kept, since another shape changes the
# exact path's reduction order, whose bit-identity with diffusers only the GPU tests re-check.
BLOCK_ELEMENTS = 4096
BLOCK_C_CHANNELS_LAST = 64  # channels per tile when channels are contiguous
BLOCK_C_NCHW = 16  # channels per tile when pixels are contiguous
NUM_WARPS = 4

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# Torch references
# ---------------------------------------------------------------------------------------------------------


def channel_norm_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """max(||x||_2 over dim 1, eps) [B, 1, H, W] in fp32, computed exactly as F.normalize does: on the
    reference's fp32 copy of half-precision inputs."""
    xf = x.float() if x.dtype in _HALF else x
    return torch.linalg.vector_norm(xf, dim=1, keepdim=True).clamp_min_(eps)


# torch splits a reduction whose operand spans 2^31 bytes or more into parts and adds their results, which
# changes the summation order. The reference's fp32 copy crosses that line at 2^29 elements.
_UNSPLIT_FP32_ELEMENTS = 2**29


def channel_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`channel_norm_reference`'s values. On CUDA, torch reduces half-precision input straight into an fp32
    accumulator (no fp32 copy: a third of the traffic); its reduction layout depends on the accumulator
    type and the shapes, not on the input's dtype, so the sums are the same. Used only where
    `direct_norm_verified` has compared both on the device, and only below the size at which torch would
    split the reduction over the copy (2048^2 decodes cross it once)."""
    if (
        x.dtype in _HALF
        and x.device.type == "cuda"
        and x.numel() < _UNSPLIT_FP32_ELEMENTS
        and direct_norm_verified(x.device, x.dtype)
    ):
        return torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float32).clamp_min_(eps)
    return channel_norm_reference(x, eps)


def rmsnorm_silu_eager_reference(
    x: torch.Tensor, gamma: torch.Tensor, scale: float, eps: float, silu: bool, norm: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference's values, with fewer passes. gamma: [C, 1, 1] in x's dtype; norm: `channel_norm(x)`.
    (x's layout, not strided outputs: torch's CPU kernels switch between vector and scalar SiLU with the
    layout, and the scalar one rounds differently.)"""
    if norm is None:
        norm = channel_norm(x, eps)
    y = torch.empty_like(x)
    # Dividing by the fp32 norm promotes x to fp32 exactly as the reference's .float() copy does; writing
    # into y rounds the fp32 quotient once to x's dtype, as the reference's .to(dtype) does.
    torch.div(x, norm, out=y)
    y.mul_(scale).mul_(gamma)  # two roundings, as `normalized * scale * gamma` (the reference's + 0.0 is exact)
    return torch.nn.functional.silu(y, inplace=True) if silu else y


def _checked_out(out: torch.Tensor, x: torch.Tensor, caller: str) -> torch.Tensor:
    if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device:
        raise ValueError(
            f"{caller}: out must be {x.dtype} {tuple(x.shape)} on {x.device}, got {out.dtype} "
            f"{tuple(out.shape)} on {out.device}"
        )
    return out


def rmsnorm_silu_reference(x: torch.Tensor, gamma: torch.Tensor, scale: float, eps: float, silu: bool = True):
    """The fast flavour's math: fp32 throughout, one rounding at the end. gamma: any shape with C elements."""
    xf = x.float()
    inv = scale / torch.linalg.vector_norm(xf, dim=1, keepdim=True).clamp_min(eps)
    y = xf * inv * gamma.float().reshape(1, -1, 1, 1)
    if silu:
        y = torch.nn.functional.silu(y)
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------------------


@jit
def _rmsnorm_silu_kernel(
    x_ptr,  # [B, C, P] via strides
    gamma_ptr,  # [C]
    y_ptr,  # [B, C, P] via strides
    C,
    P,
    x_stride_b,
    x_stride_c,
    x_stride_p,
    y_stride_b,
    y_stride_c,
    y_stride_p,
    scale,
    eps,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    APPLY_SILU: tl.constexpr,
):
    # Program (pixel block, batch): the whole channel range of BLOCK_P pixels, in two sweeps over C.
    b = tl.program_id(1).to(tl.int64)
    pixels = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    pixel_mask = pixels < P
    x_base = x_ptr + b * x_stride_b + pixels[None, :] * x_stride_p
    y_base = y_ptr + b * y_stride_b + pixels[None, :] * y_stride_p

    sum_sq = tl.zeros([BLOCK_P], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        channels = c0 + tl.arange(0, BLOCK_C)
        mask = (channels < C)[:, None] & pixel_mask[None, :]
        x = tl.load(x_base + channels[:, None].to(tl.int64) * x_stride_c, mask=mask, other=0.0).to(tl.float32)
        sum_sq += tl.sum(x * x, axis=0)
    inv = scale / tl.maximum(tl.sqrt(sum_sq), eps)  # F.normalize divides by max(||x||, eps)

    for c0 in range(0, C, BLOCK_C):
        channels = c0 + tl.arange(0, BLOCK_C)
        mask = (channels < C)[:, None] & pixel_mask[None, :]
        offsets = channels[:, None].to(tl.int64)
        x_raw = tl.load(x_base + offsets * x_stride_c, mask=mask, other=0.0)
        gamma = tl.load(gamma_ptr + channels, mask=channels < C, other=0.0).to(tl.float32)
        y = x_raw.to(tl.float32) * inv[None, :] * gamma[:, None]
        if APPLY_SILU:
            y = y * tl.sigmoid(y)
        tl.store(y_base + offsets * y_stride_c, y.to(x_raw.dtype), mask=mask)


@jit(do_not_specialize=("W",))  # the row width only splits pixel indices: one compile for every size
def _eager_tail_kernel(
    x_ptr,  # [B, C, P] via strides
    norm_ptr,  # [B, P] fp32 via strides: max(||x||, eps)
    gamma_ptr,  # [C], x's dtype
    y_ptr,  # [B, C, H, W] via strides (any: e.g. the interior of a padded buffer)
    C,
    P,
    W,
    x_stride_b,
    x_stride_c,
    x_stride_p,
    norm_stride_b,
    norm_stride_p,
    y_stride_b,
    y_stride_c,
    y_stride_h,
    y_stride_w,
    scale,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
    APPLY_SILU: tl.constexpr,
    LIBDEVICE_EXP: tl.constexpr,  # False only under the interpreter, which has no libdevice
):
    # Program (pixel block x channel block, batch). Each step rounds where the reference's kernels round.
    b = tl.program_id(1).to(tl.int64)
    blocks_c = tl.cdiv(C, BLOCK_C)
    pixels_32 = (tl.program_id(0) // blocks_c) * BLOCK_P + tl.arange(0, BLOCK_P)
    pixels = pixels_32.to(tl.int64)
    y_pixels = (pixels_32 // W).to(tl.int64) * y_stride_h + (pixels_32 % W).to(tl.int64) * y_stride_w
    channels = (tl.program_id(0) % blocks_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    pixel_mask = pixels < P
    mask = (channels < C)[:, None] & pixel_mask[None, :]
    offsets_c = channels[:, None].to(tl.int64)

    x_raw = tl.load(x_ptr + b * x_stride_b + offsets_c * x_stride_c + pixels[None, :] * x_stride_p, mask=mask)
    norm = tl.load(norm_ptr + b * norm_stride_b + pixels * norm_stride_p, mask=pixel_mask, other=1.0)
    gamma = tl.load(gamma_ptr + channels, mask=channels < C, other=0.0).to(tl.float32)
    dtype = x_raw.dtype
    q = tl.math.div_rn(x_raw.to(tl.float32), norm[None, :]).to(dtype).to(tl.float32)
    q = (q * scale).to(dtype).to(tl.float32)
    q = (q * gamma[:, None]).to(dtype).to(tl.float32)
    if APPLY_SILU:
        if LIBDEVICE_EXP:
            e = libdevice.exp(-q)  # expf, the function torch's SiLU calls
        else:
            e = tl.exp(-q)
        q = tl.math.div_rn(q, 1.0 + e)
    tl.store(y_ptr + b * y_stride_b + offsets_c * y_stride_c + y_pixels[None, :], q.to(dtype), mask=mask)


# ---------------------------------------------------------------------------------------------------------
# Launchers (strict checks) and dispatchers
# ---------------------------------------------------------------------------------------------------------


def unsupported_reason(x: torch.Tensor, gamma: torch.Tensor) -> str | None:
    """Why the kernels cannot take (x, gamma), or None when they can."""
    if x.dim() != 4:
        return f"x must be [B, C, H, W], got shape {tuple(x.shape)}"
    if x.dtype not in _DTYPES:
        return f"x dtype must be one of {_DTYPES}, got {x.dtype}"
    if gamma.numel() != x.shape[1] or gamma.device != x.device:
        return f"gamma must hold C={x.shape[1]} values on {x.device}, got {tuple(gamma.shape)} on {gamma.device}"
    if x.numel() == 0:
        return "x is empty"
    if pixel_strides(x) is None:
        return f"x strides {x.stride()} do not merge H and W into one axis"
    if not triton_runs_on(x.device):
        return f"Triton cannot run on {x.device} here"
    return None


def _tile(x: torch.Tensor) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_P) for x's layout: long runs along the contiguous axis."""
    channels = x.shape[1]
    block_c = BLOCK_C_CHANNELS_LAST if x.stride(1) == 1 else BLOCK_C_NCHW
    block_c = min(block_c, next_power_of_2(channels))
    return block_c, max(1, BLOCK_ELEMENTS // block_c)


def rmsnorm_silu_fused(x: torch.Tensor, gamma: torch.Tensor, scale: float, eps: float, silu: bool = True):
    """The fast flavour's kernel alone. Raises ValueError where it cannot run (see `unsupported_reason`)."""
    reason = unsupported_reason(x, gamma)
    if reason:
        raise ValueError(f"rmsnorm_silu_fused: {reason}")
    y = torch.empty_like(x)
    batch, channels, height, width = x.shape
    pixels = height * width
    block_c, block_p = _tile(x)
    grid = (cdiv(pixels, block_p), batch)
    launch(
        _rmsnorm_silu_kernel,
        grid,
        x,
        gamma.reshape(-1).contiguous(),
        y,
        channels,
        pixels,
        *pixel_strides(x),
        *pixel_strides(y),
        float(scale),
        float(eps),
        BLOCK_C=block_c,
        BLOCK_P=block_p,
        APPLY_SILU=silu,
        num_warps=NUM_WARPS,
    )
    return y


def rmsnorm_silu_eager_fused(
    x: torch.Tensor,
    gamma: torch.Tensor,
    scale: float,
    eps: float,
    silu: bool,
    norm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact flavour's kernel alone (norm from torch). gamma must be in x's dtype; out as for the
    reference (any strides)."""
    reason = unsupported_reason(x, gamma)
    if reason is None and gamma.dtype != x.dtype:
        reason = f"gamma dtype {gamma.dtype} must equal x dtype {x.dtype} (the reference multiplies in x's dtype)"
    if reason is None and x[0, 0].numel() >= 2**31:
        reason = f"{x.shape[2]}x{x.shape[3]} pixels per channel exceed the kernel's 32-bit pixel index"
    if reason:
        raise ValueError(f"rmsnorm_silu_eager_fused: {reason}")
    if norm is None:
        norm = channel_norm(x, eps)
    y = torch.empty_like(x) if out is None else _checked_out(out, x, "rmsnorm_silu_eager_fused")
    batch, channels, height, width = x.shape
    pixels = height * width
    block_c, block_p = _tile(x)
    if norm.shape != (batch, 1, height, width) or norm.dtype != torch.float32:
        got = f"{norm.dtype} {tuple(norm.shape)}"
        raise ValueError(f"rmsnorm_silu_eager_fused: norm must be fp32 [B, 1, H, W], got {got}")
    norm_strides = pixel_strides(norm)
    if norm_strides is None:
        norm = norm.contiguous()
        norm_strides = pixel_strides(norm)
    grid = (cdiv(pixels, block_p) * cdiv(channels, block_c), batch)
    launch(
        _eager_tail_kernel,
        grid,
        x,
        norm,
        gamma.reshape(-1).contiguous(),
        y,
        channels,
        pixels,
        width,
        *pixel_strides(x),
        norm_strides[0],
        norm_strides[2],
        *y.stride(),
        float(scale),
        BLOCK_C=block_c,
        BLOCK_P=block_p,
        APPLY_SILU=silu,
        LIBDEVICE_EXP=not INTERPRETER_ACTIVE,
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,  # no fused multiply-add: each op rounds on its own, like torch's kernels
        enable_reflect_ftz=False,  # libdevice expf keeps subnormals, like torch's expf
    )
    return y


def rmsnorm_silu_eager(
    x: torch.Tensor, gamma: torch.Tensor, scale: float, eps: float, silu: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact flavour: the reference's values, written to `out` if given (any strides). The fused kernel runs
    only on CUDA devices where `eager_kernel_verified` proved it identical to torch for x's dtype (and
    writes `out` directly); else the torch reference (then copied into `out`)."""
    norm = channel_norm(x, eps)
    if (
        x.device.type == "cuda"
        and unsupported_reason(x, gamma) is None
        and gamma.dtype == x.dtype
        and eager_kernel_verified(x.device, x.dtype)
    ):
        return rmsnorm_silu_eager_fused(x, gamma, scale, eps, silu, norm, out)
    y = rmsnorm_silu_eager_reference(x, gamma, scale, eps, silu, norm)
    return y if out is None else _checked_out(out, x, "rmsnorm_silu_eager").copy_(y)


# ---------------------------------------------------------------------------------------------------------
# Self-test that lets exact mode use the eager kernel
# ---------------------------------------------------------------------------------------------------------

SELF_TESTS = SelfTests("rmsnorm_silu")  # checks "eager_kernel" and "direct_norm"
_FP32_CHUNK = 1 << 24  # fp32 bit patterns per SiLU comparison (64 MiB per tensor)


def _all_values(dtype: torch.dtype, device: torch.device, start: int = 0, count: int | None = None):
    """Every bit pattern of dtype (or `count` of them from `start`) as a flat tensor of dtype."""
    int_dtype, width = (torch.int32, 32) if dtype == torch.float32 else (torch.int16, 16)
    count = (1 << width) - start if count is None else count
    patterns = torch.arange(start, start + count, device=device, dtype=torch.int64)
    patterns = torch.where(patterns >= 1 << (width - 1), patterns - (1 << width), patterns)
    return patterns.to(int_dtype).view(dtype)


def _silu_matches(values: torch.Tensor) -> bool:
    """SiLU of every value through the kernel (norm = scale = gamma = 1 pass q = x through exactly) vs torch."""
    x = values.view(1, 1, 1, -1)
    ones = torch.ones(1, device=x.device, dtype=x.dtype)
    got = rmsnorm_silu_eager_fused(x, ones, 1.0, 0.0, True, torch.ones_like(x, dtype=torch.float32))
    return same_bits(got, torch.nn.functional.silu(x))


def _chain_matches(dtype: torch.dtype, device: torch.device) -> bool:
    """The whole chain (with and without SiLU) on NCHW and channels-last inputs of odd sizes, with values
    spread over many decades, pixels of subnormal values and gammas that push products subnormal."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    decades = 2.0 if dtype == torch.float16 else 8.0
    tiny = torch.finfo(dtype).tiny
    for channels, height, width in ((3, 7, 5), (144, 9, 33), (1152, 4, 8)):
        x = torch.randn(2, channels, height, width, generator=gen)
        x *= torch.exp(torch.randn(2, 1, height, width, generator=gen) * decades)
        x[:, :, 0, 0] = torch.randn(2, channels, generator=gen) * tiny  # subnormal pixels
        gamma = torch.randn(channels, 1, 1, generator=gen) * 2
        gamma[::5] *= tiny  # subnormal products
        x, gamma = x.to(device, dtype), gamma.to(device, dtype)
        for layout in (torch.contiguous_format, torch.channels_last):
            xl = x.contiguous(memory_format=layout)
            norm = channel_norm(xl, 1e-12)
            for silu in (False, True):  # want ends as the SiLU chain, used below
                want = rmsnorm_silu_eager_reference(xl, gamma, channels**0.5, 1e-12, silu, norm)
                if not same_bits(rmsnorm_silu_eager_fused(xl, gamma, channels**0.5, 1e-12, silu, norm), want):
                    return False
            # Written into the interior of a padded buffer: same values, the border untouched.
            padded = torch.full((2, channels, height + 2, width + 3), 7.0, device=device, dtype=dtype)
            interior = padded[:, :, 1:-1, 2:-1]
            rmsnorm_silu_eager_fused(xl, gamma, channels**0.5, 1e-12, True, norm, out=interior)
            if not same_bits(interior, want):
                return False
            interior.fill_(7.0)
            if not bool((padded == 7.0).all()):
                return False
    return True


# Shapes of the direct-norm check: [B, C, H, W] covering torch's reduction layouts (one thread per output;
# channels split over a block; over several blocks when outputs are few), up to the decoder's sizes.
_NORM_CHECK_SHAPES = ((2, 3, 7, 5), (1, 144, 256, 256), (2, 288, 33, 17), (1, 576, 32, 32), (1, 1152, 64, 64))


def _direct_norm_matches(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(1)
    for shape in _NORM_CHECK_SHAPES:
        x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, *shape[2:], generator=gen))
        x = x.to(device, dtype)
        for layout in (torch.contiguous_format, torch.channels_last):
            xl = x.contiguous(memory_format=layout)
            direct = torch.linalg.vector_norm(xl, dim=1, keepdim=True, dtype=torch.float32)
            if not same_bits(direct, torch.linalg.vector_norm(xl.float(), dim=1, keepdim=True)):
                return False
    return True


def direct_norm_verified(device: torch.device, dtype: torch.dtype) -> bool:
    """True when torch's fp32-accumulated norm of half-precision input equals the norm of the fp32 copy bit
    for bit on `device`, for every layout in _NORM_CHECK_SHAPES (NCHW and channels-last). Once per
    (device, dtype); a few ms."""
    return SELF_TESTS.passed("direct_norm", device, dtype, lambda: _direct_norm_matches(device, dtype))


def _eager_kernel_matches(device: torch.device, dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        chunks = range(0, 1 << 32, _FP32_CHUNK)
        silu_ok = all(_silu_matches(_all_values(dtype, device, s, _FP32_CHUNK)) for s in chunks)
    else:
        silu_ok = _silu_matches(_all_values(dtype, device))
    return silu_ok and _chain_matches(dtype, device)


def eager_kernel_verified(device: torch.device, dtype: torch.dtype) -> bool:
    """True when the exact flavour's kernel reproduced torch bit for bit on `device` for `dtype`: SiLU on
    every value of the dtype, and the full chain on hard inputs. Runs once per (device, dtype): quick for the
    half-precision dtypes (2^16 values), noticeably longer for fp32 (2^32 values, checked in chunks)."""
    return SELF_TESTS.passed("eager_kernel", device, dtype, lambda: _eager_kernel_matches(device, dtype))
