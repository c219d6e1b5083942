"""`GGUFLinear`: a DiT block Linear whose weight stays in a GGUF file's blocks (Q8_0 ... Q6_K) in memory.

The weight is dequantised right before its GEMM, into a transient weight in the activation dtype (one Triton kernel
per row segment: kernels/dequantize_gguf.py), and multiplied there; nothing else keeps a float copy, so the model
needs the file's bytes and one layer's float weight at a time. A streamed block travels in its GGUF bytes.

Our fused layers (to_qkv: q | k | v, gate_up: gate | up) are made of row segments, each a checkpoint tensor with a
type of its own (a Q4_K_M file keeps to_v in Q6_K): one uint8 parameter per segment, [rows, row bytes].

It is a QuantLinear for the block math (quant/linear.py's weight-only path: quant_math.py calls it as a layer) and
for LoRAs, which run beside it (`set_side_paths`, exact; its blocks are never requantised: lora/merge.py). The
first segment is `qweight`, the others `qweight_1`, ..., so that merge code that names a quantised layer by
`<layer>.qweight` finds it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.dequantize_gguf import BLOCKS, dequantize_gguf, row_bytes
from .linear import QuantLinear
from .slots import QuantSlot

# The decode step's GGUFPrefetch (quant/gguf_prefetch.py) on the thread running it: the layers take their weight
# from it while it is set
_active = threading.local()


def active_prefetch():
    return getattr(_active, "prefetch", None)


def set_active_prefetch(prefetch) -> None:
    _active.prefetch = prefetch


@dataclass(frozen=True)
class GGUFFormat:
    """What QuantLinear's users read of a layer's format: its name for logs, no rotation."""

    types: tuple[str, ...]  # each segment's GGUF type
    kind: str = "gguf"
    rotation: int = 0

    @property
    def name(self) -> str:
        return "gguf:" + "/".join(dict.fromkeys(self.types))

    @property
    def storage(self) -> torch.dtype:
        return torch.uint8


class GGUFLinear(QuantLinear):
    """y = x W^T, W [N, K] stored as GGUF blocks in row segments: segments = ((rows, type), ...) in row order."""

    def __init__(self, in_features: int, segments: tuple[tuple[int, str], ...], compute_dtype=torch.bfloat16):
        nn.Module.__init__(self)  # not QuantLinear's: no fp8/int8 weight and scale
        for rows, qtype in segments:
            if qtype not in BLOCKS:
                raise ValueError(f"GGUF type {qtype!r} is not supported; supported: {', '.join(BLOCKS)}")
            row_bytes(qtype, in_features)  # raises for a width that is not whole blocks
            if rows < 1:
                raise ValueError(f"a GGUF segment needs at least one row, got {rows}")
        self.segments = tuple((int(rows), qtype) for rows, qtype in segments)
        self._in, self._out = in_features, sum(rows for rows, _ in self.segments)
        self.fmt = GGUFFormat(tuple(qtype for _, qtype in self.segments))
        self.compute_dtype = compute_dtype
        self.quantize_activations = False
        self.side_path = None
        self.param_dtypes = {}
        for index, (rows, qtype) in enumerate(self.segments):
            name = self.segment_name(index)
            blocks = torch.empty(rows, row_bytes(qtype, in_features), dtype=torch.uint8)
            self.register_parameter(name, nn.Parameter(blocks, requires_grad=False))
            self.param_dtypes[name] = torch.uint8

    @staticmethod
    def segment_name(index: int) -> str:
        return "qweight" if index == 0 else f"qweight_{index}"

    @property
    def in_features(self) -> int:
        return self._in

    @property
    def out_features(self) -> int:
        return self._out

    def segment(self, row: int) -> tuple[int, int]:
        """(segment index, its first row) of the segment that holds `row`."""
        start = 0
        for index, (rows, _) in enumerate(self.segments):
            if row < start + rows:
                return index, start
            start += rows
        raise IndexError(f"row {row} is beyond this layer's {self._out} rows")

    def extra_repr(self) -> str:
        return f"in_features={self._in}, out_features={self._out}, format={self.fmt.name}"

    # ---- arithmetic --------------------------------------------------------------------------------

    def backend(self, rows: int) -> str:
        return "weight_only"

    def quantize_input(self, x2d, **pre):
        raise RuntimeError("a GGUF layer multiplies in the activation dtype: it has no quantised-input GEMM")

    def project(self, q, scale, backend):
        raise RuntimeError("a GGUF layer multiplies in the activation dtype: it has no quantised-input GEMM")

    def dequantized_weight(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight [N, K] in `dtype`, each segment's rows written by its dequantisation (fp32 math, one
        rounding): transient, for one GEMM; into `out` (contiguous [N, K]) where given."""
        first = self.get_parameter("qweight")
        if out is None:
            out = torch.empty(self._out, self._in, dtype=dtype, device=first.device)
        start = 0
        for index, (rows, qtype) in enumerate(self.segments):
            dequantize_gguf(self.get_parameter(self.segment_name(index)), qtype, self._in, dtype,
                            out=out[start : start + rows])  # fmt: skip
            start += rows
        return out

    def weight_only(self, x: torch.Tensor) -> torch.Tensor:
        prefetch = active_prefetch()
        weight = prefetch.weight(self, x.dtype) if prefetch is not None else None
        return F.linear(x, weight if weight is not None else self.dequantized_weight(x.dtype))

    def float_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantized_weight(torch.float32).to(dtype)


class GGUFSlot(QuantSlot):
    """One segment of a GGUFLinear (rows [start, stop): one checkpoint tensor) as the loader's destination: the
    file's blocks copied as they are, or a float tensor's values in a float segment's type."""

    def __init__(self, layer: GGUFLinear, start: int = 0, stop: int | None = None):
        super().__init__(layer, start, stop)
        index, first = layer.segment(start)
        if first != start or layer.segments[index][0] != self.rows.stop - self.rows.start:
            raise ValueError(f"rows {start}:{stop} are not one GGUF segment of this layer ({layer.segments})")
        self.index = index
        self.qtype = layer.segments[index][1]

    @property
    def device(self) -> torch.device:
        return self._blocks.device

    @property
    def _blocks(self) -> torch.Tensor:
        return self.layer.get_parameter(GGUFLinear.segment_name(self.index))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_gguf(self._blocks, self.qtype, self.layer.in_features, dtype)

    @torch.no_grad()
    def fill(self, tensor: torch.Tensor, stored_type: str | None = None) -> None:
        """`tensor`: uint8 rows of blocks of `stored_type` (a GGUF block type), or a float tensor [rows, K]."""
        blocks = self._blocks
        if stored_type is not None:
            if stored_type != self.qtype:
                raise ValueError(f"a {stored_type} tensor for a {self.qtype} segment")
            blocks.copy_(tensor.reshape(blocks.shape))
            return
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"GGUF slot of shape {self.shape} got a tensor of shape {tuple(tensor.shape)}")
        if self.qtype not in FLOAT_STORAGE:
            raise ValueError(f"a float tensor for a {self.qtype} segment: the file's blocks are expected")
        blocks.copy_(tensor.to(blocks.device, FLOAT_STORAGE[self.qtype]).contiguous().view(torch.uint8)
                     .view(blocks.shape))  # fmt: skip


FLOAT_STORAGE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
