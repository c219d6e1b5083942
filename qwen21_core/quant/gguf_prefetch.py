"""A GGUF DiT's next layer dequantised while the current one multiplies (QWEN21_GGUF_PREFETCH=1, a trial).

A decode step calls the block Linears in a fixed order (each block's to_qkv, to_out, gate_up, out). With every block
resident, `GGUFPrefetch` dequantises layer j + 1 on a side stream into one of two step buffers while layer j's
GEMM, and the attention around it, run on the compute stream: the dequantisation is memory-bound and the GEMM
compute-bound, so the two can overlap. Buffer (j + 1) % 2 is refilled only once the compute stream's work enqueued so
far (layer j - 1's GEMM, its last reader) is done, and the compute stream waits for a fill before its GEMM.

A call out of that order (a layer called by other code in the middle of a step) takes the plain path for the rest of
the step. The same kernel writes the same values, so the step is the plain path's bit for bit. Inside a CUDA-graph
capture the buffers come from the graph's pool like any activation of the step, and the fork and join are events in
the graph. Not while blocks stream (a streamed block's weights arrive at its own start).
"""

from __future__ import annotations

import torch

from .. import settings
from ..startup.streams import GGUF, side_stream
from .gguf_linear import GGUFLinear, active_prefetch, set_active_prefetch

__all__ = ["GGUFPrefetch", "active_prefetch", "gguf_transient_bytes", "step_prefetch"]


class GGUFPrefetch:
    """One decode step's pipeline over `layers` (the GGUF layers in call order), on `device` in `dtype`, active
    on this thread from its making to `close()`. streams False: the fills run in order on the current stream (the
    CPU tests' way: the same bookkeeping, no concurrency)."""

    def __init__(self, layers: list[GGUFLinear], device: torch.device, dtype: torch.dtype, streams: bool = True):
        self.layers = layers
        self.order = {id(layer): j for j, layer in enumerate(layers)}
        self.device, self.dtype = device, dtype
        self.side = side_stream(device, GGUF) if streams else None
        size = max(layer.out_features * layer.in_features for layer in layers)
        # compute-stream tensors, written on the side stream: freed after the step's join
        self.buffers = [torch.empty(size, dtype=dtype, device=device) for _ in range(2)]
        self.filled: list[torch.cuda.Event | None] = [None, None]
        self.expected = 0
        self.on = True
        self._fill(0)
        set_active_prefetch(self)

    def _fill(self, j: int) -> None:
        layer = self.layers[j]
        out = self.buffers[j % 2][: layer.out_features * layer.in_features].view(layer.out_features, -1)
        if self.side is None:
            layer.dequantized_weight(self.dtype, out=out)
            return
        fork = torch.cuda.Event()
        fork.record(torch.cuda.current_stream(self.device))  # after the GEMM that last read this buffer
        with torch.cuda.stream(self.side):
            self.side.wait_event(fork)
            layer.dequantized_weight(self.dtype, out=out)
            done = torch.cuda.Event()
            done.record(self.side)
        self.filled[j % 2] = done

    def weight(self, layer: GGUFLinear, dtype: torch.dtype) -> torch.Tensor | None:
        """The layer's dequantised weight, ready for the current stream, and the next layer's fill started; None
        where the call is out of order (then, for the rest of the step, the plain path)."""
        j = self.order.get(id(layer))
        if not self.on or j != self.expected or dtype != self.dtype:
            self.on = False
            return None
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_event(self.filled[j % 2])
        weight = self.buffers[j % 2][: layer.out_features * layer.in_features].view(layer.out_features, -1)
        self.expected = j + 1
        if self.expected < len(self.layers):
            self._fill(self.expected)
        return weight

    def close(self) -> None:
        """End the step: the compute stream waits for the side stream, and the buffers go back to the allocator."""
        set_active_prefetch(None)
        if self.side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
        self.buffers = self.filled = None


def step_prefetch(model, x: torch.Tensor) -> GGUFPrefetch | None:
    """A GGUFPrefetch for a decode step of `model` (QwenImage21Transformer) on x, or None where it does not apply (the
    setting off, not on CUDA, streaming blocks, no GGUF layer)."""
    if not x.is_cuda or model.streamer is not None or not settings.current().gguf_prefetch:
        return None
    layers = [layer for block in model.transformer_blocks for layer in block.linears().values()
              if isinstance(layer, GGUFLinear)]  # fmt: skip
    return GGUFPrefetch(layers, x.device, x.dtype) if layers else None


def gguf_transient_bytes(model) -> int:
    """Device bytes a decode step of `model` holds in dequantised GGUF weights at once, beyond its activations: the
    largest GGUF layer in the compute dtype, twice with QWEN21_GGUF_PREFETCH (two step buffers); 0 without GGUF
    layers. The memory estimates of a run add it (pipeline.py, the ComfyUI MODEL's memory_required)."""
    if not isinstance(model, torch.nn.Module):  # a stand-in (tests of the sizing): no layers
        return 0
    sizes = [layer.out_features * layer.in_features for layer in model.modules() if isinstance(layer, GGUFLinear)]
    if not sizes:
        return 0
    element = torch.empty(0, dtype=model.dtype).element_size()
    return max(sizes) * element * (2 if settings.current().gguf_prefetch else 1)
