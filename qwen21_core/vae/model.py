"""The Qwen-Image-2.1 VAE (RGBA, 16x, z_dim 64) for single images: encode and decode one frame.

The released model is a Wan-2.2-style residual video VAE applied to one frame (the reference: diffusers'
`AutoencoderKLQwenImage21`). For an image every "causal 3-D" conv is a 2-D conv, so this implementation works on 4-D
tensors [B, C, H, W] throughout and has NO temporal feature caches: the reference keeps a full copy of every conv input
for frames that never come (gigabytes at 1024^2). The `time_conv` weights of the temporal resamplers never run for a
single frame; they are read from checkpoints and dropped.

Exact mode performs, for every value, the same floating-point operations in the same order as the reference,
so its results are bit-identical to the reference on the same device and dtype (fp32 on CPU in
tests/test_vae.py; fp32 and bf16 on the GPU in its GPU tests and benchmarks/bench_vae.py). It is only leaner:
* no temporal caches and no defensive clones;
* the channel RMS norm (the reference's fp32 copy, its norm, fp32 divide, cast, `* sqrt(C)`, `* gamma`,
  `+ 0.0` and SiLU) is torch's norm of the half-precision input, without the copy, plus one fused pass on
  the GPU, once self-tests proved both bit-identical to torch (kernels/rmsnorm_silu.py); elsewhere the
  divide writes the activation dtype directly and the rest runs in place;
* a norm followed by a padded 3x3 conv writes straight into the interior of a zero-bordered buffer laid
  out as F.pad would lay it out, so the conv reads the same tensor without the reference's padded copy;
* nearest 2x upsampling runs in the activation dtype (a pure copy, so the same values as the reference's
  fp32 round trip, at a quarter of the traffic);
* the parameter-free "DupUp" shortcut of the up blocks is added through strided views (no 4x gather).

All arithmetic goes through an ops object, `ExactOps` here and `fast.FastOps` for quality="fast", so the
modules below are written once. Weights are cast to the activation dtype on use, which makes the decode and
encode precision (fp32 / bf16 / fp16) independent of the dtype the weights are stored in. In fp16 every conv
output and residual sum is clamped to the finite fp16 range, so large activations cannot turn into inf/NaN.

Cancel: `decode(check_interrupt=...)` is called between the decoder's blocks (after the mid block and after
every residual block of the up blocks: 16 points at the released size), so one long untiled pass can stop
midway. It only reads a flag; the arithmetic is untouched.

Tiling, memory planning and OOM retry live in tiling.py; the fast paths in fast.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import bias_residual
from ...kernels import rmsnorm_silu as norm_kernel
from ..config import VAEConfig
from . import tiling as vae_tiling

log = logging.getLogger(__name__)

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TILING_MODES = ("auto", "on", "off")
# What one decode or encode call may hold: a side of 8192 px per image, and 2^28 pixels in all (4 GiB of float32
# RGBA output, e.g. 256 images of 1024^2). Past that a latent was made larger than any model output by mistake
# (an upscale by a link) and would take the process's memory with it.
MAX_IMAGE_SIDE = 8192
MAX_CALL_PIXELS = 2**28
_FULL_SIZE = VAEConfig()
QUALITIES = ("exact", "fast")
# quality -> ops factory for the non-exact paths; vae/fast.py registers "fast" (it builds on this module, so
# this module cannot import it)
_QUALITY_OPS: dict[str, Callable] = {}


def register_quality(name: str, factory: Callable) -> None:
    """Make `ops_for(name)` return `factory(vae)`; used by the fast paths' module."""
    if name not in QUALITIES or name == "exact":
        raise ValueError(f"unknown VAE quality {name!r}")
    _QUALITY_OPS[name] = factory


_NORM_EPS = 1e-12  # F.normalize's default, which the reference uses
_FP16_MAX = torch.finfo(torch.float16).max
_SAME_3X3 = (1, 1, 1, 1)  # the reference's explicit zero padding before its 3x3 "causal" convs
_PAD_RIGHT_BOTTOM = (0, 1, 0, 1)  # before the stride-2 downsampling conv


# ---------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------


def resolve_precision(precision, default: torch.dtype) -> torch.dtype:
    """None -> default (the module's dtype); "fp32" / "bf16" / "fp16" or the torch dtype itself."""
    if precision is None:
        return default
    if isinstance(precision, torch.dtype) and precision in PRECISIONS.values():
        return precision
    if precision in PRECISIONS:
        return PRECISIONS[precision]
    raise ValueError(f"precision must be None or one of {sorted(PRECISIONS)}, got {precision!r}")


def resolve_tiling(tiling) -> str:
    """Tiling mode "auto", "on" or "off" (True and False are read as "on" and "off")."""
    if tiling is True:
        return "on"
    if tiling is False:
        return "off"
    if tiling in TILING_MODES:
        return tiling
    raise ValueError(f"tiling must be one of {list(TILING_MODES)}, got {tiling!r}")


# ---------------------------------------------------------------------------------------------------------
# Exact arithmetic
# ---------------------------------------------------------------------------------------------------------


def cast_param(p: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A weight in the activation dtype (no copy when it already is)."""
    return None if p is None else p.to(dtype)


def suggested_memory_format(x: torch.Tensor) -> torch.memory_format:
    """The layout torch gives the output of F.pad(x) (its `suggest_memory_format`): channels-last when x's
    strides order the dims C, W, H, N from fastest to slowest, with torch's tie-breaks for size-1 dims;
    otherwise NCHW. The convs' kernels, and so their results, depend on this layout."""
    sizes, strides = x.shape, x.stride()
    if strides[1] == 0:
        return torch.contiguous_format
    smallest = 0
    for d in (1, 3, 2, 0):
        if sizes[d] == 0 or strides[d] < smallest or (d == 0 and smallest == strides[1]):
            return torch.contiguous_format
        smallest = strides[d] * (sizes[d] if sizes[d] > 1 else 1)
    return torch.channels_last


def zero_bordered_empty(x: torch.Tensor, pad: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded, interior): an uninitialised tensor of x's shape grown by `pad` (left, right, top, bottom), in
    the layout F.pad(x, pad) would have, its border zeroed; and the view of its interior for the caller to
    fill."""
    left, right, top, bottom = pad
    batch, channels, height, width = x.shape
    shape = (batch, channels, top + height + bottom, left + width + right)
    padded = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=suggested_memory_format(x))
    padded[:, :, :top].zero_()
    padded[:, :, top + height :].zero_()
    padded[:, :, top : top + height, :left].zero_()
    padded[:, :, top : top + height, left + width :].zero_()
    return padded, padded[:, :, top : top + height, left : left + width]


def fp16_guard_(x: torch.Tensor) -> torch.Tensor:
    """In fp16, clamp in place to the finite range: an overflowing conv or sum becomes +-65504, not inf
    (inf would turn into NaN in the next norm or difference). A no-op for other dtypes."""
    if x.dtype == torch.float16:
        x.clamp_(-_FP16_MAX, _FP16_MAX)
    return x


def conv_bias_residual(
    x: torch.Tensor, conv: nn.Conv2d, residual: torch.Tensor | None, padding: tuple[int, int] | int
) -> torch.Tensor:
    """F.conv2d(x, conv's weight and bias, padding), then + residual, each result through the fp16 guard.

    On CUDA torch adds a conv's bias in a pass of its own after cuDNN; where kernels/bias_residual.py's
    self-test confirmed that, the conv runs without its bias and one kernel adds the bias and the residual,
    with the same roundings (bit-identical) in a third of the traffic."""
    weight, bias = cast_param(conv.weight, x.dtype), cast_param(conv.bias, x.dtype)
    args = (conv.stride, padding, conv.dilation, conv.groups)
    clamp = x.dtype == torch.float16
    if bias is not None and x.device.type == "cuda" and bias_residual.epilogue_verified(x.device, x.dtype):
        y = F.conv2d(x, weight, None, *args)
        if bias_residual.unsupported_reason(y, bias, residual) is None:
            return bias_residual.add_bias_residual_(y, bias, residual, clamp_fp16=clamp)
        return bias_residual.add_bias_residual_reference(y, bias, residual, clamp_fp16=clamp)
    y = fp16_guard_(F.conv2d(x, weight, bias, *args))
    return y if residual is None else fp16_guard_(y.add_(residual))


class ExactOps:
    """The reference's arithmetic, value for value (see the module docstring)."""

    quality = "exact"

    def session(self, device: torch.device):
        """Context for a whole decode (global backend settings); none for exact."""
        return contextlib.nullcontext()

    def begin(self, x: torch.Tensor) -> torch.Tensor:
        """The layout activations enter the network in."""
        return x.contiguous()

    def conv(self, x: torch.Tensor, conv: nn.Conv2d, pad: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        """`conv` on x; `pad` (left, right, top, bottom) is zero padding applied first, as the reference does
        before its "causal" convs (their own padding is 0)."""
        return self.conv_add(x, conv, None, pad)

    def conv_add(
        self,
        x: torch.Tensor,
        conv: nn.Conv2d,
        residual: torch.Tensor | None,
        pad: tuple[int, int, int, int] | None = None,
    ) -> torch.Tensor:
        """`conv` on x (padded first as in `conv`), plus `residual` if given: a block's residual sum."""
        if pad is not None:
            x = F.pad(x, pad)
        return conv_bias_residual(x, conv, residual, conv.padding)

    def norm(
        self, x: torch.Tensor, norm: ChannelRMSNorm, silu: bool, pad: tuple[int, int, int, int] | None = None
    ) -> torch.Tensor:
        """x / max(||x||_2 over channels, eps) * sqrt(C) * gamma, then SiLU if asked; result in x's dtype.
        With `pad` the result is written straight into the interior of a zero-bordered buffer: the tensor
        F.pad would build, without its copy."""
        gamma = cast_param(norm.gamma, x.dtype).view(-1, 1, 1)
        if pad is None:
            return norm_kernel.rmsnorm_silu_eager(x, gamma, norm.scale, _NORM_EPS, silu)
        padded, interior = zero_bordered_empty(x, pad)
        norm_kernel.rmsnorm_silu_eager(x, gamma, norm.scale, _NORM_EPS, silu, out=interior)
        return padded

    def norm_conv(
        self,
        x: torch.Tensor,
        norm: ChannelRMSNorm,
        silu: bool,
        conv: nn.Conv2d,
        pad: tuple[int, int, int, int] | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """conv(zero-pad(norm(x), pad)) (+ residual): the pattern of every residual block and head."""
        return self.conv_add(self.norm(x, norm, silu, pad), conv, residual)

    def upsample_conv(self, x: torch.Tensor, resample: Resample) -> torch.Tensor:
        """Nearest 2x upsampling, then the 3x3 conv."""
        # nearest-exact at scale 2 copies values, so upsampling in x's dtype equals the reference's fp32 trip.
        x = F.interpolate(x, scale_factor=2.0, mode="nearest-exact")
        return self.conv(x, resample.resample[1])

    def attention(self, x: torch.Tensor, block: AttentionBlock) -> torch.Tensor:
        """Single-head self-attention over the H*W positions, plus the residual."""
        b, c, h, w = x.shape
        qkv = self.norm_conv(x, block.norm, False, block.to_qkv)  # [B, 3C, H, W]
        # [B, 1, HW, 3C]: the same strides as the reference, so SDPA takes the same kernel.
        qkv = qkv.reshape(b, 1, 3 * c, h * w).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v)  # [B, 1, HW, C]
        del q, k, v, qkv
        y = y.squeeze(1).permute(0, 2, 1).reshape(b, c, h, w)
        y = self.conv(y, block.proj)
        # Out of place, in this operand order: the result's memory layout (and so the next convs' kernels)
        # follows the reference.
        return fp16_guard_(y + x)

    def add_(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """x += other (a residual sum)."""
        return fp16_guard_(x.add_(other))


# ---------------------------------------------------------------------------------------------------------
# Building blocks. Parameter names and shapes follow the diffusers checkpoint, so a diffusers state dict
# (less the time_conv weights) loads 1:1; 3x3 convs keep padding 0 because the reference pads explicitly.
# ---------------------------------------------------------------------------------------------------------


class ChannelRMSNorm(nn.Module):
    """RMS norm over the channel axis of [B, C, H, W] with a learned per-channel scale (no bias).

    gamma has the checkpoint's shape: [C, 1, 1, 1] in the residual blocks and heads, [C, 1, 1] in attention.
    """

    def __init__(self, dim: int, attention: bool = False):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones((dim, 1, 1) if attention else (dim, 1, 1, 1)))
        self.scale = dim**0.5  # F.normalize yields unit L2 norm; sqrt(C) makes it unit RMS


class ResidualBlock(nn.Module):
    """norm1 -> SiLU -> conv1 -> norm2 -> SiLU -> conv2, plus the input (1x1 conv when channels change)."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.norm1 = ChannelRMSNorm(in_dim)
        self.conv1 = nn.Conv2d(in_dim, out_dim, 3)
        self.norm2 = ChannelRMSNorm(out_dim)
        self.conv2 = nn.Conv2d(out_dim, out_dim, 3)
        self.conv_shortcut = nn.Conv2d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor, ops: ExactOps) -> torch.Tensor:
        shortcut = x if self.conv_shortcut is None else ops.conv(x, self.conv_shortcut)
        y = ops.norm_conv(x, self.norm1, True, self.conv1, _SAME_3X3)
        return ops.norm_conv(y, self.norm2, True, self.conv2, _SAME_3X3, residual=shortcut)


class AttentionBlock(nn.Module):
    """Single-head self-attention over all positions (head dim = C), only in the mid blocks."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = ChannelRMSNorm(dim, attention=True)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, ops: ExactOps) -> torch.Tensor:
        return ops.attention(x, self)


class MidBlock(nn.Module):
    """resnet -> attention -> resnet."""

    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def forward(self, x: torch.Tensor, ops: ExactOps) -> torch.Tensor:
        x = self.resnets[0](x, ops)
        x = self.attentions[0](x, ops)
        return self.resnets[1](x, ops)


class Resample(nn.Module):
    """2x spatial resampling with a 3x3 conv: nearest upsample + conv, or right/bottom zero pad + stride-2
    conv. The conv sits at `resample.1` as in the checkpoint; `resample.0` is the parameter-free resampler
    (documentation of the structure; the ops do the resampling themselves, in the activation dtype)."""

    def __init__(self, dim: int, out_dim: int, up: bool):
        super().__init__()
        if up:
            self.resample = nn.Sequential(
                nn.Upsample(scale_factor=2.0, mode="nearest-exact"), nn.Conv2d(dim, out_dim, 3, padding=1)
            )
        else:
            self.resample = nn.Sequential(nn.ZeroPad2d(_PAD_RIGHT_BOTTOM), nn.Conv2d(dim, out_dim, 3, stride=2))
        self.up = up


def _avg_down_shortcut(x: torch.Tensor, out_dim: int, temporal: bool, down: bool) -> torch.Tensor:
    """The encoder blocks' parameter-free shortcut: space-to-channel (2x2 when `down`), then the mean over
    groups of consecutive channels down to out_dim. A temporal block first puts a zero frame before the single
    frame (the reference pads video to an even frame count), so half of its groups average zeros.

    The tensors are laid out exactly as the reference lays them out before its mean, so the reduction adds
    in the same order: [B, C, T, (ft), H', (fs), W', (fs)] -> [B, out, group, 1, H', W'].
    """
    ft, fs = (2 if temporal else 1), (2 if down else 1)
    b, c, h, w = x.shape
    frames = x.unsqueeze(2)
    if temporal:
        frames = torch.cat([torch.zeros_like(frames), frames], dim=2)
    expanded = frames.view(b, c, 1, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6).contiguous()
    group = c * ft * fs * fs // out_dim
    return expanded.view(b, out_dim, group, 1, h // fs, w // fs).mean(dim=2).squeeze(2)


def _add_dup_up_shortcut_(y: torch.Tensor, x: torch.Tensor, temporal: bool, ops: ExactOps) -> torch.Tensor:
    """y [B, out, 2H, 2W] += the up blocks' parameter-free shortcut of their input x [B, in, H, W].

    The reference repeats each input channel, folds (frame, 2x2) out of the channels and keeps the last frame.
    Worked out, output pixel (2h+i, 2w+j) of channel o copies input channel a*o + offset(i, j) at (h, w), with
    a = in/out and offset = (4*(ft-1) + 2i + j) // (4*ft/a). Added through strided views: no gathered copy.
    """
    out_dim, in_dim = y.shape[1], x.shape[1]
    if in_dim % out_dim:
        raise ValueError(f"up block shortcut: input channels {in_dim} must be a multiple of output channels {out_dim}")
    a = in_dim // out_dim
    ft = 2 if temporal else 1
    repeats = 4 * ft // a
    offset = [[(4 * (ft - 1) + 2 * i + j) // repeats for j in (0, 1)] for i in (0, 1)]
    y6 = y.unflatten(3, (-1, 2)).unflatten(2, (-1, 2))  # [B, out, H, 2, W, 2], a view of y
    if offset[0][0] == offset[0][1] == offset[1][0] == offset[1][1]:
        y6.add_(x[:, offset[0][0] :: a, :, None, :, None])  # one source per output channel
    elif offset[0][0] == offset[0][1] and offset[1][0] == offset[1][1]:
        for i in (0, 1):  # the source depends on the row parity only: two passes over alternate rows
            y6[:, :, :, i].add_(x[:, offset[i][0] :: a, :, :, None])
    else:
        for i in (0, 1):
            for j in (0, 1):
                y6[:, :, :, i, :, j].add_(x[:, offset[i][j] :: a])
    return fp16_guard_(y)


class DownBlock(nn.Module):
    """Encoder stage: residual blocks, optional 2x downsampling, plus the averaging shortcut."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, down: bool):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResidualBlock(in_dim if k == 0 else out_dim, out_dim) for k in range(num_res_blocks)
        )
        self.downsampler = Resample(out_dim, out_dim, up=False) if down else None
        self.temporal = temporal
        self.out_dim = out_dim

    def forward(self, x: torch.Tensor, ops: ExactOps) -> torch.Tensor:
        block_input = x
        for resnet in self.resnets:
            x = resnet(x, ops)
        if self.downsampler is not None:
            x = ops.conv(x, self.downsampler.resample[1], _PAD_RIGHT_BOTTOM)
        down = self.downsampler is not None
        return ops.add_(x, _avg_down_shortcut(block_input, self.out_dim, self.temporal, down))


class UpBlock(nn.Module):
    """Decoder stage: num_res_blocks + 1 residual blocks, then optional 2x upsampling plus its shortcut."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, temporal: bool, up: bool):
        super().__init__()
        self.resnets = nn.ModuleList(
            ResidualBlock(in_dim if k == 0 else out_dim, out_dim) for k in range(num_res_blocks + 1)
        )
        self.upsampler = Resample(out_dim, out_dim, up=True) if up else None
        self.temporal = temporal

    def forward(self, x: torch.Tensor, ops: ExactOps, check: Callable[[], None] = lambda: None) -> torch.Tensor:
        block_input = x
        for resnet in self.resnets:
            x = resnet(x, ops)
            check()
        if self.upsampler is None:
            return x
        x = ops.upsample_conv(x, self.upsampler)
        return _add_dup_up_shortcut_(x, block_input, self.temporal, ops)


class Encoder(nn.Module):
    """[B, 4, H, W] in [-1, 1] -> [B, 2*z_dim, H/16, W/16] (mean and log-variance before quant_conv)."""

    def __init__(self, config: VAEConfig):
        super().__init__()
        dims = [config.base_dim * m for m in (1, *config.dim_mult)]
        stages = len(config.dim_mult)
        self.conv_in = nn.Conv2d(config.in_channels, dims[0], 3)
        self.down_blocks = nn.ModuleList(
            DownBlock(
                dims[i],
                dims[i + 1],
                config.num_res_blocks,
                temporal=i < stages - 1 and config.temperal_downsample[i],
                down=i < stages - 1,
            )
            for i in range(stages)
        )
        self.mid_block = MidBlock(dims[-1])
        self.norm_out = ChannelRMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], 2 * config.z_dim, 3)

    def forward(self, x: torch.Tensor, ops: ExactOps) -> torch.Tensor:
        x = ops.conv(ops.begin(x), self.conv_in, _SAME_3X3)
        for block in self.down_blocks:
            x = block(x, ops)
        x = self.mid_block(x, ops)
        return ops.norm_conv(x, self.norm_out, True, self.conv_out, _SAME_3X3)


class Decoder(nn.Module):
    """[B, z_dim, h, w] (after post_quant_conv) -> [B, 4, 16h, 16w], not yet clamped."""

    def __init__(self, config: VAEConfig):
        super().__init__()
        base = config.decoder_base_dim or config.base_dim
        dims = [base * m for m in (config.dim_mult[-1], *reversed(config.dim_mult))]
        stages = len(config.dim_mult)
        temporal_up = tuple(reversed(config.temperal_downsample))
        self.conv_in = nn.Conv2d(config.z_dim, dims[0], 3)
        self.mid_block = MidBlock(dims[0])
        self.up_blocks = nn.ModuleList(
            UpBlock(
                dims[i],
                dims[i + 1],
                config.num_res_blocks,
                temporal=i < stages - 1 and temporal_up[i],
                up=i < stages - 1,
            )
            for i in range(stages)
        )
        self.norm_out = ChannelRMSNorm(dims[-1])
        self.conv_out = nn.Conv2d(dims[-1], config.out_channels, 3)

    def forward(self, x: torch.Tensor, ops: ExactOps, check: Callable[[], None] = lambda: None) -> torch.Tensor:
        """check(): an interruption point, called between blocks (see InterruptPoints)."""
        x = ops.conv(ops.begin(x), self.conv_in, _SAME_3X3)
        x = self.mid_block(x, ops)
        check()
        for block in self.up_blocks:
            x = block(x, ops, check)
        return ops.norm_conv(x, self.norm_out, True, self.conv_out, _SAME_3X3)


class InterruptPoints:
    """The decoder's interruption points: each calls `check_interrupt()`, which raises to stop the decode.

    On CUDA the host queues kernels far ahead of the GPU, so a check could pass before the GPU has even begun
    the work it guards. Each point therefore first waits for the GPU to finish the work queued before the
    PREVIOUS point: the host stays at most one block ahead, so the GPU still has the current block queued while the
    host waits, and a cancel takes effect within about two blocks of GPU time. (Its cost is measured by
    bench_vae's `exact_interruptible` line.)"""

    def __init__(self, check_interrupt: Callable[[], None], device: torch.device):
        self.check_interrupt = check_interrupt
        self.cuda = device.type == "cuda"
        self.previous = None

    def __call__(self) -> None:
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            if self.previous is not None:
                self.previous.synchronize()
            self.previous = event
        self.check_interrupt()


# ---------------------------------------------------------------------------------------------------------
# The VAE
# ---------------------------------------------------------------------------------------------------------


def _check_config(config: VAEConfig) -> None:
    stages = len(config.dim_mult)
    problems = []
    if not config.is_residual:
        problems.append("is_residual must be True (Qwen-Image-2.1 uses the residual Wan-2.2 blocks)")
    if config.attn_scales:
        problems.append("attn_scales must be empty (only the mid blocks have attention)")
    if config.patch_size not in (None, 1):
        problems.append(f"patch_size must be None, got {config.patch_size}")
    if config.in_channels != 4 or config.out_channels != 4:
        problems.append(f"in/out_channels must be 4 (RGBA), got {config.in_channels}/{config.out_channels}")
    if len(config.temperal_downsample) != stages - 1:
        problems.append(f"temperal_downsample needs {stages - 1} entries (one per downsampling), got "
                        f"{len(config.temperal_downsample)}")  # fmt: skip
    if problems:
        raise ValueError("VAE config not supported: " + "; ".join(problems))


class QwenImage21VAE(nn.Module):
    """The Qwen-Image-2.1 RGBA VAE for single images.

    Construct from a `VAEConfig` (also on the meta device; the model has no buffers, so `to_empty` followed by
    copying every checkpoint tensor into `checkpoint_slots()` loads it completely).

    decode(latents) -> RGBA images [B, 16h, 16w, 4] float32 in 0..1; encode(images) -> raw latents (the
    posterior mean). Both accept tiling ("auto" / "on" / "off"), tile_size (pixels), precision (None = the
    weights' dtype, "fp32" / "bf16" / "fp16") and a progress callback; decode also quality ("exact" / "fast").
    `tiling_config` holds the tiling defaults (vae_tiling.TilingConfig); decode never changes it.
    """

    def __init__(self, config: VAEConfig | None = None):
        super().__init__()
        config = config or VAEConfig()
        _check_config(config)
        self.config = config
        self.encoder = Encoder(config)
        self.quant_conv = nn.Conv2d(2 * config.z_dim, 2 * config.z_dim, 1)
        self.post_quant_conv = nn.Conv2d(config.z_dim, config.z_dim, 1)
        self.decoder = Decoder(config)
        self.tiling_config = vae_tiling.TilingConfig()
        self.last_decode_info: dict = {}
        self.last_encode_info: dict = {}
        self._exact_ops = ExactOps()

    @property
    def dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    # -- checkpoints --------------------------------------------------------------------------------------

    def dropped_checkpoint_keys(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint keys read and dropped (the temporal resamplers' time_conv), with their shapes."""
        cfg = self.config
        stages = len(cfg.dim_mult)
        enc_dims = [cfg.base_dim * m for m in (1, *cfg.dim_mult)]
        base = cfg.decoder_base_dim or cfg.base_dim
        dec_dims = [base * m for m in (cfg.dim_mult[-1], *reversed(cfg.dim_mult))]
        dropped = {}
        for i in range(stages - 1):
            if cfg.temperal_downsample[i]:  # encoder: dim -> dim, 1x1
                d = enc_dims[i + 1]
                dropped[f"encoder.down_blocks.{i}.downsampler.time_conv.weight"] = (d, d, 1, 1)
                dropped[f"encoder.down_blocks.{i}.downsampler.time_conv.bias"] = (d,)
            if cfg.temperal_downsample[::-1][i]:  # decoder: dim -> 2*dim (two frames), 1x1
                d = dec_dims[i + 1]
                dropped[f"decoder.up_blocks.{i}.upsampler.time_conv.weight"] = (2 * d, d, 1, 1)
                dropped[f"decoder.up_blocks.{i}.upsampler.time_conv.bias"] = (2 * d,)
        return dropped

    def checkpoint_slots(self) -> dict[str, torch.Tensor | None]:
        """Every key of a diffusers-layout checkpoint -> the parameter its tensor is copied into (same shape),
        or None for keys that are read and dropped (time_conv)."""
        slots: dict[str, torch.Tensor | None] = dict(self.named_parameters())
        slots.update(dict.fromkeys(self.dropped_checkpoint_keys()))
        return slots

    @torch.no_grad()
    def load_diffusers_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
        """Copy a diffusers-layout state dict into the parameters. Returns (missing, unexpected) key lists;
        raises ValueError on a shape mismatch, and (strict) on missing or unexpected keys."""
        slots = self.checkpoint_slots()
        dropped = self.dropped_checkpoint_keys()
        missing = [k for k in slots if k not in state_dict]
        unexpected = [k for k in state_dict if k not in slots]
        mismatched = []
        for key, tensor in state_dict.items():
            if key not in slots:
                continue
            expected = slots[key].shape if slots[key] is not None else torch.Size(dropped[key])
            if tuple(tensor.shape) != tuple(expected):
                mismatched.append(f"{key}: checkpoint {tuple(tensor.shape)}, model {tuple(expected)}")
        if mismatched:
            raise ValueError(f"VAE state dict has {len(mismatched)} shape mismatches: " + "; ".join(mismatched[:10]))
        if strict and (missing or unexpected):
            raise ValueError(
                f"VAE state dict does not match the config: {len(missing)} missing keys {missing[:8]}, "
                f"{len(unexpected)} unexpected keys {unexpected[:8]}. Is it a Qwen-Image-2.1 VAE in diffusers "
                "layout, and does the config match it?"
            )
        for key, tensor in state_dict.items():
            if slots.get(key) is not None:
                slots[key].copy_(tensor)
        return missing, unexpected

    # -- latent normalisation -----------------------------------------------------------------------------

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Built like the reference pipeline (fp32 tensor, then cast), so the constants round identically.
        mean = torch.tensor(self.config.latents_mean).view(1, -1, 1, 1).to(like.device, like.dtype)
        std = torch.tensor(self.config.latents_std).view(1, -1, 1, 1).to(like.device, like.dtype)
        return mean, std

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw VAE latents [B, z, h, w] -> the transformer's space: (z - mean) / std per channel."""
        mean, std = self._latent_stats(raw)
        return (raw - mean) / std

    def denormalize(self, normalised: torch.Tensor) -> torch.Tensor:
        """The transformer's latents -> raw VAE latents: z * std + mean per channel."""
        mean, std = self._latent_stats(normalised)
        return normalised * std + mean

    # -- decode -------------------------------------------------------------------------------------------

    def activation_scale(self, kind: str) -> float:
        """This model's activations against the full-size VAE's, for the tiling plan: the ratio of the channel
        width at full resolution (decoder for "decode", encoder for "encode")."""
        if kind == "decode":
            ours = self.config.decoder_base_dim or self.config.base_dim
            return ours / (_FULL_SIZE.decoder_base_dim or _FULL_SIZE.base_dim)
        return self.config.base_dim / _FULL_SIZE.base_dim

    def untiled_decode_bytes(self, latent_shape, precision=None, quality: str = "exact") -> int:
        """Free device memory an untiled decode of latents of `latent_shape` [B, z, h, w] plans with (tiling "auto"
        decodes untiled when that much is free): what to ask a memory manager for before decoding."""
        factor = self.config.spatial_compression
        quality = "exact" if quality == "exact" else "fast"
        return vae_tiling.untiled_bytes("decode", quality, resolve_precision(precision, self.dtype), latent_shape[0],
                                        latent_shape[2] * factor, latent_shape[3] * factor,
                                        self.activation_scale("decode"))  # fmt: skip

    def ops_for(self, quality: str) -> ExactOps:
        """The arithmetic for quality "exact" or "fast" (the fast paths install on first use)."""
        if quality == "exact":
            return self._exact_ops
        factory = _QUALITY_OPS.get(quality)
        if factory is None:
            raise ValueError(f"quality must be one of {list(QUALITIES)}, got {quality!r}")
        return factory(self)

    @torch.no_grad()
    def decode_pixels(
        self, latents: torch.Tensor, ops: ExactOps | None = None, check_interrupt: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """One untiled pass: raw latents [B, z, h, w] (in the compute dtype, on this device) -> pixels
        [B, 4, 16h, 16w] in [-1, 1], in the latents' dtype. Equals the reference's decode(...).sample.
        check_interrupt: called between decoder blocks (see InterruptPoints); it may raise to stop."""
        ops = ops or self._exact_ops
        x = ops.conv(latents, self.post_quant_conv)
        if check_interrupt is None:
            x = self.decoder(x, ops)
        else:
            x = self.decoder(x, ops, InterruptPoints(check_interrupt, x.device))
        return x.clamp_(-1.0, 1.0)

    @torch.no_grad()
    def decode(
        self,
        latents: torch.Tensor,
        *,
        tiling="auto",
        tile_size: int | None = None,
        precision=None,
        quality: str = "exact",
        callback: Callable[[int, int], None] | None = None,
        check_interrupt: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Raw latents [B, z_dim, h, w] -> RGBA images [B, 16h, 16w, 4] float32 in 0..1 on the latents' device.

        tiling:    "auto" (tile only when an untiled pass would not fit in free GPU memory, or on the CPU in
                   the RAM a pass may take: vae_tiling.available_bytes),
                   "on" or "off". Out-of-memory while tiling retries with halved tiles (see vae_tiling).
        tile_size: tile side in output pixels (multiple of 16); None = tiling_config.tile_size, or under
                   "auto" the largest tile that fits.
        precision: None (the weights' dtype), "fp32", "bf16" or "fp16".
        quality:   "exact" (the reference's numerics) or "fast" (fused kernels, channels-last, folded
                   upsampling; not bit-identical, see vae/fast.py).
        callback:  callback(done, total) after every tile (once when untiled); it may raise to interrupt.
        check_interrupt: check_interrupt() between decoder blocks, inside every pass (so also inside one
                   untiled decode); it raises to interrupt. Results are the same with or without it.
        """
        if not isinstance(latents, torch.Tensor) or latents.dim() != 4 or latents.shape[1] != self.config.z_dim:
            got = tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__
            raise ValueError(f"latents must be a tensor [B, {self.config.z_dim}, h, w] of raw VAE latents, got {got}")
        if not latents.is_floating_point():
            raise TypeError(f"latents must be a float tensor, got {latents.dtype}")
        factor = self.config.spatial_compression
        check_call_pixels("decode", "latents", latents.shape[0], latents.shape[2] * factor, latents.shape[3] * factor)
        dtype = resolve_precision(precision, self.dtype)
        mode = resolve_tiling(tiling)
        ops = self.ops_for(quality)
        z = latents.to(self.device, dtype)
        with ops.session(z.device):
            pixels, info = vae_tiling.run(
                lambda tile: self.decode_pixels(tile, ops, check_interrupt),
                z,
                kind="decode",
                mode=mode,
                tile_size=tile_size,
                config=self.tiling_config,
                quality=ops.quality,
                callback=callback,
                activation_scale=self.activation_scale("decode"),
            )
        self.last_decode_info = {**info, "quality": ops.quality, "precision": _dtype_name(dtype)}
        images = pixels.float().mul_(0.5).add_(0.5).clamp_(0.0, 1.0)
        return images.permute(0, 2, 3, 1).contiguous().to(latents.device)

    # -- encode -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """One untiled pass: pixels [B, 4, H, W] in [-1, 1] (compute dtype, this device) -> raw latents
        [B, z, H/16, W/16]. Equals the reference's encode(...).latent_dist.mode()."""
        ops = self._exact_ops
        moments = ops.conv(self.encoder(pixels, ops), self.quant_conv)
        return moments[:, : self.config.z_dim].contiguous()  # the posterior mean (mode)

    @torch.no_grad()
    def encode(
        self,
        images: torch.Tensor,
        *,
        tiling="auto",
        tile_size: int | None = None,
        precision=None,
        callback: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """Images [B, H, W, C] float 0..1, C = 4 (RGBA) or 3 (RGB, encoded as opaque), H and W multiples of 16
        -> raw latents [B, z_dim, H/16, W/16] (the posterior mean, not normalised) on the images' device.
        tiling, tile_size, precision, callback: as for decode."""
        if not isinstance(images, torch.Tensor) or images.dim() != 4 or images.shape[-1] not in (3, 4):
            got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
            raise ValueError(f"images must be a tensor [B, H, W, 3 or 4] (channels last, 0..1), got {got}")
        if not images.is_floating_point():
            raise TypeError(f"images must be a float tensor in 0..1, got {images.dtype}")
        factor = self.config.spatial_compression
        height, width = images.shape[1:3]
        if height % factor or width % factor:
            raise ValueError(
                f"image height and width must be multiples of {factor}, got {height}x{width}; crop or resize "
                f"to e.g. {height // factor * factor}x{width // factor * factor}"
            )
        check_call_pixels("encode", "images", images.shape[0], height, width)
        dtype = resolve_precision(precision, self.dtype)
        mode = resolve_tiling(tiling)
        x = images.to(self.device, torch.float32).permute(0, 3, 1, 2)
        if x.shape[1] == 3:
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        # 0..1 -> [-1, 1] in fp32 like the reference's image processor, then the compute dtype, NCHW-contiguous.
        x = (2.0 * x - 1.0).to(dtype).contiguous()
        latents, info = vae_tiling.run(
            self.encode_pixels,
            x,
            kind="encode",
            mode=mode,
            tile_size=tile_size,
            config=self.tiling_config,
            quality="exact",
            callback=callback,
            activation_scale=self.activation_scale("encode"),
        )
        self.last_encode_info = {**info, "precision": _dtype_name(dtype)}
        return latents.to(images.device, dtype)  # tiles blend in fp32; return the compute dtype either way


def check_call_pixels(kind: str, what: str, batch: int, height: int, width: int) -> None:
    """Refuse a decode or encode larger than MAX_IMAGE_SIDE per side or MAX_CALL_PIXELS in all, before anything is
    allocated."""
    if max(height, width) > MAX_IMAGE_SIDE:
        raise ValueError(
            f"VAE {kind}: {what} of {width}x{height} px; one image may be at most {MAX_IMAGE_SIDE} px per side. "
            "Make the latent or image smaller (an upscale node may have been set too high)."
        )
    if batch * height * width > MAX_CALL_PIXELS:
        per_call = max(1, MAX_CALL_PIXELS // (height * width))
        raise ValueError(
            f"VAE {kind}: {what} of {batch} images at {width}x{height} px is {batch * height * width:,} px; one call "
            f"may hold at most {MAX_CALL_PIXELS:,} px ({per_call} images of this size). Split the batch."
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return next((name for name, d in PRECISIONS.items() if d == dtype), str(dtype))
