"""quality="fast" for the VAE decoder: the same modules and weights, cheaper arithmetic.

`FastOps` replaces the exact ops (vae.ExactOps) where the module structure allows, and falls back to them
everywhere else:

* channels-last activations end to end (cuDNN's native layout for half-precision convs);
* convs take their zero padding inside (no padded copy of every conv input);
* channel RMS norm + SiLU in one fused Triton kernel (kernels/rmsnorm_silu.py: fp32 math, one rounding)
  where Triton runs (CUDA); elsewhere the exact norm;
* "folded" upsampling: nearest 2x upsample followed by a 3x3 conv equals a stride-2 transposed conv with a
  4x4 kernel whose taps are sums of the 3x3 taps, so the 4x-larger upsampled tensor is never built and the
  conv does 4/9 of the multiply-adds. Derivation: output row 2h+i reads upsampled rows 2h+i-1..2h+i+1, i.e.
  input rows h-1, h, h (i=0) or h, h, h+1 (i=1); so the transposed-conv tap k of the 4-tap kernel carries
  3x3 rows {k=0: 2, k=1: 1+2, k=2: 0+1, k=3: 0} (padding 1), the same along columns. Folded in fp32 when
  a decode first needs it, then cast; kept only for the tiles of that decode;
* single-head attention reads q, k, v straight out of the channels-last qkv (no permuted copies);
* cuDNN autotuning (benchmark mode) for the duration of the decode.

Installation is structural, not by class name: `fast_ops(vae)` walks the decoder and records which
resamplers can be folded (a nearest x2 upsampler followed by a 3x3, stride-1, padding-1, ungrouped conv
with zero padding). Parameters are never replaced or renamed, so the state dict is unchanged and exact
mode is untouched; nothing derived from the weights outlives the decode call.

Quality: not bit-identical to exact (fp32 sums in another order, one rounding per norm instead of four,
folded weights rounded once). Tested on the tiny VAE in tests/test_vae.py (>= 40 dB against exact on the GPU);
on the full-size VAE with random weights benchmarks/bench_vae.py measures the PSNR against exact (the target was
>= 45 dB). Nothing checks the PSNR at run time.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import rmsnorm_silu as norm_kernel
from .model import (
    _NORM_EPS,
    AttentionBlock,
    ChannelRMSNorm,
    ExactOps,
    QwenImage21VAE,
    Resample,
    cast_param,
    conv_bias_residual,
    fp16_guard_,
    register_quality,
)

log = logging.getLogger(__name__)

# cuDNN autotuning inside fast decodes: a steady fast decode is faster with it, and the first one at a new size pays
# a search (bench_vae.py --placeholders measures both). On, since `quality: fast` is the opt-in for throughput and
# the search happens once per size per process.
CUDNN_BENCHMARK = True

# Which 3x3 rows (and columns) feed each tap of the folded 4x4 transposed conv (see the module docstring).
_FOLD_TAPS = ((2,), (1, 2), (0, 1), (0,))


def fold_upsample_conv_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[out, in, 3, 3] conv weight -> [in, out, 4, 4] transposed-conv weight of upsample+conv, in dtype
    (summed in fp32 or better, rounded once)."""
    precise = torch.promote_types(weight.dtype, torch.float32)
    taps = torch.zeros(4, 3, device=weight.device, dtype=torch.float32)
    for k, rows in enumerate(_FOLD_TAPS):
        taps[k, list(rows)] = 1.0
    folded = torch.einsum("pa,qb,oiab->iopq", taps.to(precise), taps.to(precise), weight.to(precise))
    return folded.to(dtype).contiguous(memory_format=torch.channels_last)


def _is_zero_padded_conv(conv, kernel: int, stride: int, padding: int) -> bool:
    weight = getattr(conv, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 4
        and tuple(weight.shape[2:]) == (kernel, kernel)
        and tuple(getattr(conv, "stride", ())) == (stride, stride)
        and tuple(getattr(conv, "padding", ())) == (padding, padding)
        and tuple(getattr(conv, "dilation", ())) == (1, 1)
        and getattr(conv, "groups", None) == 1
        and getattr(conv, "padding_mode", None) == "zeros"
    )


def _is_foldable_upsampler(module: nn.Module) -> bool:
    """A nearest x2 upsampler followed by a 3x3 / stride 1 / padding 1 conv."""
    seq = getattr(module, "resample", None)
    if not isinstance(seq, nn.Sequential) or len(seq) != 2:
        return False
    upsample, conv = seq[0], seq[1]
    scale = getattr(upsample, "scale_factor", None)
    scale = tuple(scale) if isinstance(scale, tuple) else (scale, scale)
    return (
        getattr(upsample, "mode", None) in ("nearest", "nearest-exact")
        and scale == (2.0, 2.0)
        and getattr(upsample, "size", None) is None
        and _is_zero_padded_conv(conv, kernel=3, stride=1, padding=1)
    )


@contextlib.contextmanager
def _cudnn_benchmark(enabled: bool):
    """Set only cuDNN's benchmark flag for the block (torch.backends.cudnn.flags would reset the others)."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


class FastOps(ExactOps):
    """Fast arithmetic; each method falls back to the exact one where its preconditions fail."""

    quality = "fast"

    def __init__(self, foldable: set[int]):
        self.foldable = foldable  # ids of the resamplers whose upsample + conv can be folded
        self.folded: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # for the tiles of one decode only

    def session(self, device: torch.device):
        return _cudnn_benchmark(CUDNN_BENCHMARK) if device.type == "cuda" else contextlib.nullcontext()

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous(memory_format=torch.channels_last)

    def conv_add(self, x, conv, residual, pad=None) -> torch.Tensor:
        if pad is None or conv.padding != (0, 0) or len(set(pad)) != 1:
            return super().conv_add(x, conv, residual, pad)
        return conv_bias_residual(x, conv, residual, pad[0])  # symmetric: the conv pads inside, no padded copy

    def norm(self, x: torch.Tensor, norm: ChannelRMSNorm, silu: bool, pad=None) -> torch.Tensor:
        if pad is not None or norm_kernel.unsupported_reason(x, norm.gamma) is not None:  # e.g. CPU, no Triton
            return super().norm(x, norm, silu, pad)
        return norm_kernel.rmsnorm_silu_fused(x, norm.gamma, norm.scale, _NORM_EPS, silu)

    def norm_conv(self, x, norm, silu, conv, pad=None, residual=None) -> torch.Tensor:
        return self.conv_add(self.norm(x, norm, silu), conv, residual, pad)  # the conv pads inside

    def upsample_conv(self, x: torch.Tensor, resample: Resample) -> torch.Tensor:
        if id(resample) not in self.foldable:
            return super().upsample_conv(x, resample)
        conv = resample.resample[1]
        key = (id(resample), x.dtype)
        if key not in self.folded:
            self.folded[key] = fold_upsample_conv_weight(conv.weight, x.dtype)
        weight = self.folded[key]
        y = F.conv_transpose2d(x, weight, cast_param(conv.bias, x.dtype), stride=2, padding=1)
        return fp16_guard_(y)

    def attention(self, x: torch.Tensor, block: AttentionBlock) -> torch.Tensor:
        if not x.is_contiguous(memory_format=torch.channels_last):
            return super().attention(x, block)
        b, c, h, w = x.shape
        qkv = self.norm_conv(x, block.norm, False, block.to_qkv)
        if not qkv.is_contiguous(memory_format=torch.channels_last):
            return super().attention(x, block)
        # Channels-last [B, 3C, H, W] is [B, HW, 3C] in memory: q, k, v are column blocks of it.
        q, k, v = qkv.permute(0, 2, 3, 1).reshape(b, 1, h * w, 3 * c).chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v)  # [B, 1, HW, C]
        del q, k, v, qkv
        y = y.view(b, h, w, c).permute(0, 3, 1, 2)  # channels-last [B, C, H, W], no copy
        return fp16_guard_(self.conv(y, block.proj).add_(x))


def fast_ops(vae: QwenImage21VAE) -> FastOps:
    """FastOps for this VAE, after a structural check of its decoder (cheap; done on every call so that a
    module swapped in later is seen)."""
    foldable = set()
    upsamplers = 0
    for module in vae.decoder.modules():
        if isinstance(getattr(module, "resample", None), nn.Sequential):
            upsamplers += getattr(module, "up", False)
            if _is_foldable_upsampler(module):
                foldable.add(id(module))
    if len(foldable) < upsamplers:
        log.warning("VAE fast path: %d of %d upsamplers have an unexpected structure; they run exact",
                    upsamplers - len(foldable), upsamplers)  # fmt: skip
    return FastOps(foldable)


register_quality("fast", fast_ops)
