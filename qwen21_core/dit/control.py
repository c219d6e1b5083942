"""The Fun-Controlnet-Union branch of Qwen-Image-2.1 (alibaba-pai's 2.1 Fun-Controlnet-Union; ComfyUI's
QwenImage21FunControl): control and inpainting as a second stream of DiT blocks beside the base.

The math (VideoX-Fun's reference, DiffSynth-Studio's and native ComfyUI's agree):
- the stream starts from the base's block-0 input x: c = before_proj(Z) + x, where Z is zero on the prefix rows
  and control_img_in(context) on the target rows; context is 129 channels per latent pixel: the control image's
  normalised latents (64), a keep mask (1), the masked image's latents (64);
- after base block `inject[k]` (0, 2, ..., 30 for 32 base and 16 control blocks) control block k runs on c with the
  base's modulation, rotary tables and block-causal attention, and strength * after_proj(c) is added to every row of
  the base's hidden state.

The prefix rows never attend to the target (block-causal), so the control stream's prefix rows, and the base's
prefix rows with their control skips, are the same at every step: `prefill` computes them once and keeps the
control blocks' prefix K/V in a cache of their own, as the base's; a decode step runs the target rows of both
streams only. (The references recompute the whole sequence at every controlled step.) The controlled base prefix
differs from the plain one (the skips reach it), so a step outside the control range runs a plain branch with its
own prefix (sampler.py).

Checkpoint names are the file's (`control_img_in`, `control_blocks.{i}.…`, `before_proj` in block 0 only); the
blocks are the DiT's own `Block` (fused QKV and gate+up, quantisable and streamable the same way). A quantised
branch quantises its skips too (`after_proj`, a D x D GEMM per control block on every image row, which in bf16
would run at half the speed of the fp8 blocks' GEMMs): `QuantizedSkip`, its bias and the strength-weighted add in
the GEMM's epilogue (kernels/linear_epilogue.py).

The control stream's target rows depend on the base's only through the block-0 input, so with QWEN21_CONTROL_STREAM=1
(a trial, off by default) a decode step enqueues all control blocks first on a second CUDA stream and the base takes
block k's output when it needs it (`ControlState.run_ahead`, `take`, `join`): the two chains' kernels can fill each
other's idle moments. The same kernels on the same inputs: the result is the one-stream step's, bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ...kernels.linear_epilogue import linear_epilogue
from .. import settings
from ..config import TransformerConfig
from ..memory.host_copy import HostCopy
from ..memory.streaming import LayerStreamer
from ..quant.linear import QuantLinear
from ..quant.slots import QuantSlot
from ..quant.weights import QuantFormat
from ..startup.streams import CONTROL, side_stream
from .block_stack import BlockStack
from .kv_cache import KVCacheSpec, PrefixKVCache
from .transformer import QUANTIZABLE, Block

CONTROL_CHANNELS = 129  # control latents (64) + keep mask (1) + masked-image latents (64)
SKIP = "after_proj"  # a quantisation plan's name for a control block's skip projection: (block index, SKIP)


def injection_layers(num_base_layers: int, num_control_blocks: int) -> tuple[int, ...]:
    """The base blocks after which the control blocks run, in order: every (base // control)-th from 0, as the
    released adapter was trained (0, 2, ..., 30 for 32 and 16)."""
    if not 1 <= num_control_blocks <= num_base_layers:
        raise ValueError(f"a control branch of {num_control_blocks} blocks cannot pair with a DiT of "
                         f"{num_base_layers} blocks")  # fmt: skip
    return tuple(range(0, num_base_layers, num_base_layers // num_control_blocks))[:num_control_blocks]


class QuantizedSkip(nn.Module):
    """A control block's after_proj with its weight quantised (a QuantLinear) and its bias in the compute dtype."""

    def __init__(self, linear: QuantLinear, bias: nn.Parameter):
        super().__init__()
        self.linear = linear
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: QuantFormat) -> QuantizedSkip:
        """`linear` quantised (on the meta device only its type changes: the loader fills it)."""
        weight = linear.weight
        if weight.device.type == "meta":
            layer = QuantLinear(linear.in_features, linear.out_features, fmt, compute_dtype=weight.dtype)
        else:
            layer = QuantLinear.from_weight(weight.detach(), fmt)
        return cls(layer, nn.Parameter(linear.bias.detach(), requires_grad=False))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return self.linear(c) + self.bias

    def add_to(self, h: torch.Tensor, c: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """h + gate * (W c + b) for h, c [B, S, D] and gate [B', D] (B' >= B): the quantised GEMM, then one epilogue
        pass for the bias and the weighted add."""
        b, s, d = h.shape
        projected = self.linear.project_rows(c.reshape(b * s, -1))
        out = linear_epilogue(projected.data, row_scale=projected.row_scale, col_scale=projected.col_scale,
                              bias=self.bias, residual=h.reshape(b * s, d), gate=gate, rows_per_batch=s)  # fmt: skip
        return out.view(b, s, d)


def add_skip(h: torch.Tensor, skip: nn.Module, c: torch.Tensor, strength: float, gate: torch.Tensor) -> torch.Tensor:
    """h + strength * skip(c): a bf16 skip as torch adds it (the strength exact), a quantised one fused (the strength
    as `gate`, [B, D] in h's dtype)."""
    if isinstance(skip, QuantizedSkip):
        return skip.add_to(h, c, gate)
    return h.add(skip(c), alpha=strength)


def control_plan(fmt: QuantFormat, num_blocks: int, keep=()) -> dict[tuple[int, str], QuantFormat]:
    """Every control block Linear and skip in `fmt`, except the paths in `keep` (SKIP keeps the skips in bf16)."""
    paths = [path for path in (*QUANTIZABLE, SKIP) if path not in keep]
    return {(i, path): fmt for i in range(num_blocks) for path in paths}


class FunControlNet(BlockStack, nn.Module):
    """The control branch. config: the base DiT's (blocks of the same width, heads and MLP); mlp_ratio may differ."""

    def __init__(self, config: TransformerConfig, num_blocks: int, control_channels: int = CONTROL_CHANNELS):
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.control_img_in = nn.Linear(control_channels, dim)
        self.before_proj = nn.Linear(dim, dim)
        self.control_blocks = nn.ModuleList(Block(config) for _ in range(num_blocks))
        self.after_proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(num_blocks))
        self.streamer: LayerStreamer | None = None
        self.host_copy: HostCopy | None = None
        self.weights_id: tuple = ()

    def block_stack(self) -> nn.ModuleList:
        return self.control_blocks

    @property
    def control_channels(self) -> int:
        return self.control_img_in.in_features

    @property
    def dtype(self) -> torch.dtype:
        return self.control_img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.control_img_in.weight.device  # never streamed: where the branch runs

    def checkpoint_slots(self) -> dict[str, torch.Tensor]:
        """Every key of the released file (diffusers names; a fused `img_mlp.gate_up` is split by the key map)."""
        slots = {
            "control_img_in.weight": self.control_img_in.weight,
            "control_img_in.bias": self.control_img_in.bias,
            "control_blocks.0.before_proj.weight": self.before_proj.weight,
            "control_blocks.0.before_proj.bias": self.before_proj.bias,
        }
        for i, (block, after) in enumerate(zip(self.control_blocks, self.after_proj, strict=True)):
            slots.update(block.checkpoint_slots(f"control_blocks.{i}."))
            quantized = isinstance(after, QuantizedSkip)
            slots[f"control_blocks.{i}.after_proj.weight"] = QuantSlot(after.linear) if quantized else after.weight
            slots[f"control_blocks.{i}.after_proj.bias"] = after.bias
        return slots

    def quantize_linears(self, plan):
        """BlockStack's, plus the skips the plan names as (block index, SKIP)."""
        super().quantize_linears({key: fmt for key, fmt in plan.items() if key[1] != SKIP})
        for (index, path), fmt in plan.items():
            if path == SKIP and not isinstance(self.after_proj[index], QuantizedSkip):
                self.after_proj[index] = QuantizedSkip.from_linear(self.after_proj[index], fmt)
        return self

    def new_state(self, layout, batch: int, num_base_layers: int, strength: float, kv: KVCacheSpec | None = None,
                  heads: int | None = None) -> ControlState:  # fmt: skip
        """A branch's control state: the control blocks' K/V cache (format and placement from `kv`, as the base's) and
        the static buffer of the stream's target rows (filled by `ControlState.set_context`)."""
        cfg = self.config
        cache = PrefixKVCache(len(self.control_blocks), batch, layout.prefix_len, layout.target_len,
                              heads or cfg.num_attention_heads, cfg.attention_head_dim, self.dtype, self.device,
                              **vars(kv or KVCacheSpec()))  # fmt: skip
        with torch.inference_mode(False):
            start = torch.zeros(1, layout.target_len, cfg.inner_dim, device=self.device, dtype=self.dtype)
            gate = torch.full((batch, cfg.inner_dim), float(strength), device=self.device, dtype=self.dtype)
        inject = injection_layers(num_base_layers, len(self.control_blocks))
        return ControlState(self, cache, start, float(strength), {layer: k for k, layer in enumerate(inject)}, gate)


def control_key(control) -> tuple | None:
    """What a decode graph of a controlled branch is built on beyond the base's key: the branch's weights (by address:
    a graph reads them there), which of its blocks stream, the strength (a constant in the graph) and whether its
    blocks run on a second stream (QWEN21_CONTROL_STREAM, which a benchmark changes in one process)."""
    if control is None:
        return None
    net = control.net
    return (id(net), tuple(p.data_ptr() for p in net.parameters()), net.streaming_signature(), float(control.strength),
            settings.current().control_stream)  # fmt: skip


@dataclass
class ControlState:
    """One branch's control: the net, the control blocks' K/V cache, the stream's start on the target rows
    (before_proj(control_img_in(context)) [1, N, D], at a fixed address for graph replay), the strength and which
    base block each control block follows (base index -> control index)."""

    net: FunControlNet
    cache: PrefixKVCache
    start: torch.Tensor
    strength: float
    inject: dict[int, int]
    gate: torch.Tensor | None = None  # [batch, D]: the strength for a quantised skip's fused add (add_skip)
    context_id: object = None  # what `start` was made from (the caller's key): set_context skips a repeat
    # a decode step's control outputs run ahead (run_ahead): (event or None, c) per control block, and the side stream
    _ahead: list | None = field(default=None, repr=False)
    _side: torch.cuda.Stream | None = field(default=None, repr=False)

    def runs_ahead(self, h: torch.Tensor, base_streams: bool) -> bool:
        """Whether this step's control blocks run ahead on a side stream (QWEN21_CONTROL_STREAM=1, on CUDA, no block
        of either model streaming and this cache on the GPU: the streamers and host caches pace themselves by the one
        stream they run on)."""
        return (settings.current().control_stream and h.is_cuda and not base_streams and self.net.streamer is None
                and self.cache.placement == "gpu")  # fmt: skip

    def run_ahead(self, h: torch.Tensor, mod, branch, fns, in_graph: bool, beside: bool = True) -> None:
        """Enqueue every control block of this decode step on its target rows (h: the base's block-0 input). beside:
        on the device's side stream, where they run beside the base's blocks, which take block k's output with
        `take(k)`; `join()` ends the step. beside False: in order on the current stream, before the base's blocks
        (the same results; the CPU tests' way)."""
        stream = side_stream(h.device, CONTROL) if beside else None
        self._ahead, self._side = [], stream
        if stream is None:
            context = contextlib.nullcontext()
        else:
            fork = torch.cuda.Event()
            fork.record(torch.cuda.current_stream(h.device))
            h.record_stream(stream)  # the base's tensor, read on the side stream: not reused before that read
            context = torch.cuda.stream(stream)
        with context:
            if stream is not None:
                stream.wait_event(fork)
            c = h + self.start
            for k, block in self.net.stack_blocks():
                c = block.decode(c, mod, branch, k, fns, in_graph, cache=self.cache)
                done = None
                if stream is not None:
                    done = torch.cuda.Event()
                    done.record(stream)
                self._ahead.append((done, c))

    def take(self, k: int) -> torch.Tensor:
        """Control block k's output of the step `run_ahead` enqueued, ready for the current stream to read."""
        done, c = self._ahead[k]
        self._ahead[k] = None
        if done is not None:
            current = torch.cuda.current_stream(c.device)
            current.wait_event(done)
            c.record_stream(current)  # the side stream's tensor: its memory waits for the base's reads of it
        return c

    def join(self, device: torch.device) -> None:
        """End the step `run_ahead` began: the current stream waits for the side stream's work."""
        if self._side is not None:
            torch.cuda.current_stream(device).wait_stream(self._side)
        self._ahead, self._side = None, None

    @torch.no_grad()
    def set_context(self, context: torch.Tensor, context_id=None) -> None:
        """context: [N, 129] control tokens (latent pixels in raster order) -> the stream's start on the target rows."""
        if context_id is not None and context_id == self.context_id:
            return
        expected = (self.start.shape[1], self.net.control_channels)
        if tuple(context.shape) != expected:
            raise ValueError(f"control context must be {list(expected)} (latent pixels x channels), got "
                             f"{list(context.shape)}")  # fmt: skip
        net = self.net
        tokens = context.to(net.device, net.dtype)
        self.start.copy_(net.before_proj(net.control_img_in(tokens))[None])
        self.context_id = context_id

    def add_skip(self, h: torch.Tensor, k: int, c: torch.Tensor) -> torch.Tensor:
        """h + strength * after_proj[k](c): control block k's skip into the base's hidden state."""
        return add_skip(h, self.net.after_proj[k], c, self.strength, self.gate)

    def release(self) -> None:
        self.cache.release()
        self.context_id = None
