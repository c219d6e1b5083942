"""A conv's bias and a block's residual sum, added in one pass: y = ((y + bias[c]) + residual), in place.

On CUDA, torch's conv2d runs cuDNN without the bias and then adds the bias in a separate broadcast kernel
(torch's generic strided loop: about half the memory bandwidth); a residual block then adds its shortcut in
another pass. The VAE's exact mode asks for the conv without its bias and calls `add_bias_residual_`, which
rounds where torch rounds: the bias sum in fp32, rounded to y's dtype; the residual sum of that and the
residual, in fp32, rounded again. With `clamp_fp16` each of those values is clamped to the finite fp16
range as the VAE's fp16 guard does (NaN stays NaN, as with torch.clamp). So the result is bit-identical to
`F.conv2d(x, w, b)` followed by `.add_(residual)`, in a third of the traffic.

The kernel runs on CUDA (and on CPU under TRITON_INTERPRET=1 for tests); `add_bias_residual_reference` is
the torch formulation beside it. `epilogue_verified` checks, once per (device, dtype), that torch's conv on
the device really adds its bias as a separate rounding (a property of torch's cuDNN path, not of the math)
and that the kernel equals the torch formulation on hard inputs; callers use the kernel only then.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import SelfTests, cdiv, jit, next_power_of_2, pixel_strides, same_bits, tl, triton_runs_on
from .launch import launch

BLOCK_ELEMENTS = 4096  # elements per program (channels x pixels tile)
NUM_WARPS = 4
_FP16_MAX = torch.finfo(torch.float16).max
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def add_bias_residual_reference(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    clamp_fp16: bool = False,
) -> torch.Tensor:
    """The torch formulation: y += bias (per channel of [B, C, H, W]); then y += residual; in place."""
    if bias is not None:
        y.add_(bias.view(-1, 1, 1))
        if clamp_fp16:
            y.clamp_(-_FP16_MAX, _FP16_MAX)
    if residual is not None:
        y.add_(residual)
        if clamp_fp16:
            y.clamp_(-_FP16_MAX, _FP16_MAX)
    return y


@jit
def _clamp_finite(v, LIMIT: tl.constexpr):
    # Comparisons are false for NaN, so NaN passes through unchanged (torch.clamp keeps NaN too).
    v = tl.where(v > LIMIT, LIMIT, v)
    return tl.where(v < -LIMIT, -LIMIT, v)


@jit
def _bias_residual_kernel(
    y_ptr,  # [B, C, P] via strides, updated in place
    bias_ptr,  # [C], y's dtype
    r_ptr,  # [B, C, P] via strides (unused without HAS_RESIDUAL)
    C,
    P,
    y_stride_b,
    y_stride_c,
    y_stride_p,
    r_stride_b,
    r_stride_c,
    r_stride_p,
    HAS_RESIDUAL: tl.constexpr,
    CLAMP: tl.constexpr,
    LIMIT: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    # Program (pixel block x channel block, batch), as in the norm kernels.
    b = tl.program_id(1).to(tl.int64)
    blocks_c = tl.cdiv(C, BLOCK_C)
    pixels = (tl.program_id(0) // blocks_c).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    channels = (tl.program_id(0) % blocks_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (channels < C)[:, None] & (pixels < P)[None, :]
    offsets_c = channels[:, None].to(tl.int64)

    y_ptrs = y_ptr + b * y_stride_b + offsets_c * y_stride_c + pixels[None, :] * y_stride_p
    y = tl.load(y_ptrs, mask=mask)
    dtype = y.dtype
    bias = tl.load(bias_ptr + channels, mask=channels < C, other=0.0)
    v = (y.to(tl.float32) + bias.to(tl.float32)[:, None]).to(dtype)
    if CLAMP:
        v = _clamp_finite(v.to(tl.float32), LIMIT).to(dtype)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + b * r_stride_b + offsets_c * r_stride_c + pixels[None, :] * r_stride_p, mask=mask)
        v = (v.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if CLAMP:
            v = _clamp_finite(v.to(tl.float32), LIMIT).to(dtype)
    tl.store(y_ptrs, v, mask=mask)


def unsupported_reason(y: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None) -> str | None:
    """Why the kernel cannot take these tensors, or None when it can."""
    if y.dim() != 4 or y.dtype not in _DTYPES:
        return f"y must be [B, C, H, W] in {_DTYPES}, got {y.dtype} {tuple(y.shape)}"
    if bias.numel() != y.shape[1] or bias.dtype != y.dtype or bias.device != y.device:
        return f"bias must hold C={y.shape[1]} values of {y.dtype} on {y.device}, got {bias.dtype} {tuple(bias.shape)}"
    if residual is not None and (residual.shape != y.shape or residual.dtype != y.dtype or residual.device != y.device):
        return f"residual must match y ({y.dtype} {tuple(y.shape)}), got {residual.dtype} {tuple(residual.shape)}"
    if y.numel() == 0:
        return "y is empty"
    if pixel_strides(y) is None or (residual is not None and pixel_strides(residual) is None):
        return "y and residual need H and W mergeable into one strided axis"
    if not triton_runs_on(y.device):
        return f"Triton cannot run on {y.device} here"
    return None


def add_bias_residual_(
    y: torch.Tensor,
    bias: torch.Tensor,
    residual: torch.Tensor | None = None,
    clamp_fp16: bool = False,
) -> torch.Tensor:
    """The kernel: y += bias per channel, then += residual, in place, rounded as the reference. Raises
    ValueError where it cannot run (see `unsupported_reason`)."""
    reason = unsupported_reason(y, bias, residual)
    if reason:
        raise ValueError(f"add_bias_residual_: {reason}")
    batch, channels, height, width = y.shape
    pixels = height * width
    contiguous_channels = y.stride(1) == 1
    block_c = min(64 if contiguous_channels else 8, next_power_of_2(channels))
    block_p = max(1, BLOCK_ELEMENTS // block_c)
    grid = (cdiv(pixels, block_p) * cdiv(channels, block_c), batch)
    r = y if residual is None else residual
    launch(
        _bias_residual_kernel,
        grid,
        y,
        bias.reshape(-1).contiguous(),
        r,
        channels,
        pixels,
        *pixel_strides(y),
        *pixel_strides(r),
        HAS_RESIDUAL=residual is not None,
        CLAMP=clamp_fp16,
        LIMIT=_FP16_MAX,
        BLOCK_C=block_c,
        BLOCK_P=block_p,
        num_warps=NUM_WARPS,
    )
    return y


# ---------------------------------------------------------------------------------------------------------
# Self-test
# ---------------------------------------------------------------------------------------------------------

SELF_TESTS = SelfTests("bias_residual")  # check "epilogue"


def _epilogue_matches(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    finfo = torch.finfo(dtype)
    for channels, height, width, kernel in ((3, 7, 5, 3), (96, 9, 17, 3), (40, 6, 6, 1)):
        x = torch.randn(2, channels, height, width, generator=gen).to(device, dtype)
        weight = (torch.randn(channels, channels, kernel, kernel, generator=gen) / channels).to(device, dtype)
        bias = torch.randn(channels, generator=gen).to(device, dtype)
        residual = (torch.randn(2, channels, height - kernel + 1, width - kernel + 1, generator=gen) * 3).to(
            device, dtype
        )
        for layout in (torch.contiguous_format, torch.channels_last):
            xl = x.contiguous(memory_format=layout)
            with_bias = F.conv2d(xl, weight, bias)  # torch's own bias handling on this device
            if not same_bits(add_bias_residual_(F.conv2d(xl, weight), bias), with_bias):
                return False
            want = with_bias.add_(residual)
            if not same_bits(add_bias_residual_(F.conv2d(xl, weight), bias, residual), want):
                return False
    # Sums that overflow, NaN, signed zeros and subnormals; in fp16 also with the overflow guard.
    big = torch.tensor([finfo.max, -finfo.max, float("nan"), float("inf"), 1.0, -0.0, finfo.tiny, -finfo.tiny / 2])
    y = big.repeat(4, 1).reshape(1, 4, 8, 1).to(device, dtype)
    bias = torch.tensor([finfo.max, -finfo.max, 0.0, -0.0]).to(device, dtype)
    residual = big.flip(0).repeat(4, 1).reshape(1, 4, 8, 1).to(device, dtype)
    for clamp in (False, True) if dtype == torch.float16 else (False,):
        want = add_bias_residual_reference(y.clone(), bias, residual, clamp)
        if not same_bits(add_bias_residual_(y.clone(), bias, residual, clamp), want):
            return False
    return True


def epilogue_verified(device: torch.device, dtype: torch.dtype) -> bool:
    """True when, on `device` for `dtype`, torch's conv adds its bias as its own rounding and the kernel
    reproduces torch's bias and residual sums bit for bit. Once per (device, dtype); about a millisecond."""
    return SELF_TESTS.passed("epilogue", device, dtype, lambda: _epilogue_matches(torch.device(device), dtype))
