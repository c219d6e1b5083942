"""What a model made of a stack of `Block`s shares, whatever else it holds: the DiT (its 32 blocks) and the
Fun-Control branch (its 16 control blocks).

- placement with streaming (memory/streaming.py): `place(device, resident_layers)` keeps that many blocks on the
  device and streams the others from the model's pinned host copy; the memory managers see the StreamableStack
  interface (`num_layers`, `layer_bytes`, `device_weight_bytes`);
- `stack_blocks()`: the blocks in order with the streamer's hooks around each, for the model's own loop;
- `quantize_linears(plan)`: block Linears replaced by QuantLinears, one at a time.

A model names its stack by overriding `block_stack()`; its own device is where its non-block weights are.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..memory.host_copy import HostCopy
from ..memory.streaming import LayerStreamer, place_with_streaming
from ..quant.linear import QuantLinear
from ..quant.weights import QuantFormat


class BlockStack:
    """Mixin for an nn.Module whose heavy part is a ModuleList of blocks (see the module docstring)."""

    streamer: LayerStreamer | None = None  # set by place(): some blocks stream from host RAM
    host_copy: HostCopy | None = None  # the blocks' pinned home off the GPU (memory/host_copy.py)
    weights_id: tuple = ()  # what is merged into the weights (a LoRA stack, lora/merge.py); () = as loaded

    def block_stack(self) -> nn.ModuleList:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    # ---- placement ----------------------------------------------------------------------------------

    def stream_blocks(self, resident: int | None) -> None:
        """Keep `resident` blocks on the model's device and stream the others from pinned host RAM (None: all
        resident). The non-block weights stay where they are."""
        self.place(self.device, resident)

    def place(self, device, resident_layers: int | None = None) -> None:
        """All weights on `device`, or with only `resident_layers` blocks there and the rest streaming
        (memory/streaming.py): how a budget, or ComfyUI's partial load, maps onto this model."""
        if self.host_copy is None:
            self.host_copy = HostCopy(self.block_stack(), pin=torch.cuda.is_available())
        self.streamer = place_with_streaming(self, self.block_stack(), self.streamer, device, resident_layers,
                                             home=self.host_copy, version=self.weights_id)  # fmt: skip

    @property
    def resident_blocks(self) -> int:
        return len(self.block_stack()) if self.streamer is None else self.streamer.resident

    @property
    def num_layers(self) -> int:  # the streamable-stack interface (memory/streaming.py StreamableStack)
        return len(self.block_stack())

    @property
    def layer_bytes(self) -> int:
        """Bytes of one block's weights: the largest block's (a GGUF file may store some blocks in other types)."""
        return max(self._block_bytes(index) for index in range(len(self.block_stack())))

    def _block_bytes(self, index: int) -> int:
        return sum(p.numel() * p.element_size() for p in self.block_stack()[index].parameters())

    def device_weight_bytes(self) -> int:
        """Weights on the device now: everything but the streamed blocks, plus the staging slots."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        if self.streamer is None:
            return total
        streamed = sum(self._block_bytes(index) for index in self.streamer.host)
        return total - streamed + self.streamer.slot_bytes

    def streaming_signature(self) -> tuple:
        """Which blocks stream (part of a decode graph's key: the graph holds their copies)."""
        return () if self.streamer is None else tuple(self.streamer.streamed)

    def stack_blocks(self):
        """(index, block) in order, with the streamer's hooks around each block when streaming."""
        streamer = self.streamer
        if streamer is None:
            yield from enumerate(self.block_stack())
            return
        streamer.begin()
        for i, block in enumerate(self.block_stack()):
            streamer.before(i)
            yield i, block
            streamer.after(i)

    # ---- quantisation ------------------------------------------------------------------------------

    def quantize_linears(self, plan: Mapping[tuple[int, str], QuantFormat]):
        """Replace block Linears by QuantLinears: plan maps (block index, path in QUANTIZABLE) -> format.

        On a model built on the meta device (before loading) this only changes the layers' types; on real
        weights each layer is quantised in place of its bf16 weight, one at a time (bounded extra memory).
        """
        blocks = self.block_stack()
        for (index, path), fmt in plan.items():
            parent_name, _, name = path.rpartition(".")
            parent = blocks[index].get_submodule(parent_name)
            linear = getattr(parent, name)
            if isinstance(linear, QuantLinear):
                continue
            if linear.weight.device.type == "meta":
                layer = QuantLinear(linear.in_features, linear.out_features, fmt, compute_dtype=linear.weight.dtype)
            else:
                layer = QuantLinear.from_weight(linear.weight.detach(), fmt)
            setattr(parent, name, layer)
            del linear
        return self

    @property
    def quantization(self) -> str:
        """A few words for logs and the UI: "bf16", or e.g. "fp8 (128/128 block linears)"."""
        layers = [layer for block in self.block_stack() for layer in block.linears().values()]
        formats = sorted({layer.fmt.name for layer in layers if isinstance(layer, QuantLinear)})
        if not formats:
            return str(self.dtype).removeprefix("torch.")
        count = sum(isinstance(layer, QuantLinear) for layer in layers)
        return f"{'/'.join(formats)} ({count}/{len(layers)} block linears)"
