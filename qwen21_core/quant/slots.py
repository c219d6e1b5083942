"""Where a checkpoint tensor lands in a quantised layer: rows of its `qweight` and `weight_scale`.

The loader (checkpoints/files.py) fills plain tensors with `copy_`; a `QuantSlot` is the same idea for a
QuantLinear, or a row range of one (the DiT fuses to_q/to_k/to_v into one QKV layer, gate and up into one):
`fill(tensor, stored)` quantises a float tensor into the layer's format, or takes already quantised rows
(an int8_convrot or fp8 file) as they are when the formats match, requantising otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .linear import QuantLinear
from .weights import QuantFormat, dequantize_weight, quantize_weight, requantize


@dataclass(frozen=True)
class StoredQuant:
    """How a checkpoint stores one weight: its format and per-row (or scalar) scale."""

    fmt: QuantFormat
    scale: torch.Tensor


class QuantSlot:
    """Rows [start, stop) of a QuantLinear's weight, as a destination for one checkpoint tensor."""

    def __init__(self, layer: QuantLinear, start: int = 0, stop: int | None = None):
        self.layer = layer
        self.rows = slice(start, layer.out_features if stop is None else stop)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows.stop - self.rows.start, self.layer.in_features)

    @property
    def device(self) -> torch.device:
        return self.layer.qweight.device

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """These rows as a float weight (unrotated): what the loaded layer computes with."""
        layer = self.layer
        q, scale = layer.qweight[self.rows], layer.weight_scale[self.rows]
        return dequantize_weight(q, scale, layer.fmt.rotation, dtype)

    @torch.no_grad()
    def fill(self, tensor: torch.Tensor, stored: StoredQuant | None = None) -> None:
        """Write a checkpoint tensor (a float weight, or quantised rows with `stored`) into these rows."""
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"quantised slot of shape {self.shape} got a tensor of shape {tuple(tensor.shape)}")
        tensor = tensor.to(self.device)
        if stored is None:
            q, scale = quantize_weight(tensor, self.layer.fmt)
        else:
            q, scale = requantize(tensor, stored.scale.to(self.device), stored.fmt, self.layer.fmt)
        self.layer.qweight[self.rows].copy_(q)
        self.layer.weight_scale[self.rows].copy_(scale)


def quant_slots(module: torch.nn.Module, slots: dict) -> dict:
    """A module's state-dict slots with each QuantLinear's `qweight` / `weight_scale` pair replaced by one
    `<layer>.weight` QuantSlot, the name checkpoints use."""
    out = dict(slots)
    for name, layer in module.named_modules():
        if isinstance(layer, QuantLinear):
            prefix = f"{name}." if name else ""
            out.pop(prefix + "qweight", None)
            out.pop(prefix + "weight_scale", None)
            out[prefix + "weight"] = QuantSlot(layer)
    return out
