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
blocks are the DiT's own `Block` (fused QKV and gate+up, quantisable and streamable the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..config import TransformerConfig
from ..memory.host_copy import HostCopy
from ..memory.streaming import LayerStreamer
from .block_stack import BlockStack
from .kv_cache import KVCacheSpec, PrefixKVCache
from .transformer import Block

CONTROL_CHANNELS = 129  # control latents (64) + keep mask (1) + masked-image latents (64)


def injection_layers(num_base_layers: int, num_control_blocks: int) -> tuple[int, ...]:
    """The base blocks after which the control blocks run, in order: every (base // control)-th from 0, as the
    released adapter was trained (0, 2, ..., 30 for 32 and 16)."""
    if not 1 <= num_control_blocks <= num_base_layers:
        raise ValueError(f"a control branch of {num_control_blocks} blocks cannot pair with a DiT of "
                         f"{num_base_layers} blocks")  # fmt: skip
    return tuple(range(0, num_base_layers, num_base_layers // num_control_blocks))[:num_control_blocks]


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
            slots[f"control_blocks.{i}.after_proj.weight"] = after.weight
            slots[f"control_blocks.{i}.after_proj.bias"] = after.bias
        return slots

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
        inject = injection_layers(num_base_layers, len(self.control_blocks))
        return ControlState(self, cache, start, float(strength), {layer: k for k, layer in enumerate(inject)})


def control_key(control) -> tuple | None:
    """What a decode graph of a controlled branch is built on beyond the base's key: the branch's weights (by address:
    a graph reads them there), which of its blocks stream, and the strength (a constant in the graph)."""
    if control is None:
        return None
    net = control.net
    return (id(net), tuple(p.data_ptr() for p in net.parameters()), net.streaming_signature(), float(control.strength))


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
    context_id: object = None  # what `start` was made from (the caller's key): set_context skips a repeat

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

    def release(self) -> None:
        self.cache.release()
        self.context_id = None
