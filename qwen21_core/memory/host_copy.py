"""A module's weights in pinned host RAM, made once and kept: where the weights live while the module is off the
GPU, and what streamed layers are copied from.

Moving the fp8 text encoder off the GPU and back made every changed prompt wait seconds: `.to("cpu")` made new pageable
copies each time, and pageable memory crosses the bus in small staged pieces, far below the bus's rate
(benchmarks/bench_copy_rates.py measures both kinds of copy). With a pinned copy kept, going off the GPU is only
pointing the parameters at it (the weights did not change, nothing is copied) and coming back is one asynchronous copy
per tensor at the bus's rate.

Layers keep the flat layout layer streaming uses (memory/streaming.py `layout`): one buffer per layer, which is
also the streamed layer's source, so streaming costs no second copy. Layers may differ in their parameters (a GGUF
file keeps some blocks in other block types): each has its own layout, `layer_bytes` is the largest.

Staleness: each buffer remembers the weights' `version` (the DiT's `weights_id`, which a LoRA merge changes; ()
for weights that never change) when it was copied. A buffer copied from an older version is refreshed from the
module's current weights before it is used.

Memory: the host copy holds the module's size in RAM for as long as the model is loaded, also while the weights
are on the GPU. When the RAM the OS reports available (less a reserve, planner.host_free_bytes) cannot hold it,
the copy is made in ordinary pageable memory instead (the slow path) and the log says so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from .planner import host_free_bytes

log = logging.getLogger(__name__)

_ALIGN = 256  # bytes: every tensor in a flat layer buffer starts on this boundary (vectorised loads, any dtype)


def layout(layer: nn.Module) -> tuple[list[tuple[str, int, torch.Size, torch.dtype]], int]:
    """[(parameter name, byte offset, shape, dtype)] of a layer in its flat buffer, and the buffer size."""
    entries, offset = [], 0
    for name, param in layer.named_parameters():
        entries.append((name, offset, param.shape, param.dtype))
        nbytes = param.numel() * param.element_size()
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return entries, offset


def view(flat: torch.Tensor, offset: int, shape, dtype) -> torch.Tensor:
    count = int(torch.Size(shape).numel())
    size = count * torch.empty((), dtype=dtype).element_size()
    return flat[offset : offset + size].view(dtype).view(shape)


class HostCopy:
    """Pinned host buffers for a module's layer stack (one flat buffer per layer) and its other tensors."""

    def __init__(self, layers: Sequence[nn.Module], pin: bool):
        self.layouts = [layout(layer) for layer in layers]  # per layer: (entries, bytes)
        self.layer_bytes = max(nbytes for _, nbytes in self.layouts)
        self.pin = pin
        self.flats: dict[int, torch.Tensor] = {}  # layer index -> its flat buffer
        self._flat_versions: dict[int, object] = {}
        self.rest: dict[str, torch.Tensor] = {}  # other parameters and buffers, by name in the module
        self._rest_versions: dict[str, object] = {}
        self._warned = False

    def entries(self, index: int) -> list:
        """Layer `index`'s parameters in its flat buffer: (name, byte offset, shape, dtype)."""
        return self.layouts[index][0]

    @property
    def nbytes(self) -> int:
        flats = sum(f.numel() for f in self.flats.values())
        return flats + sum(t.numel() * t.element_size() for t in self.rest.values())

    def _empty(self, shape, dtype, nbytes: int) -> torch.Tensor:
        pin = self.pin
        if pin:
            available = host_free_bytes()
            if available is not None and available < nbytes:
                pin = False
                if not self._warned:
                    self._warned = True
                    log.warning("host RAM is short (%.1f GiB available): weights kept off the GPU in pageable "
                                "memory, which moves back several times slower", available / 2**30)  # fmt: skip
        with torch.inference_mode(False):  # ordinary tensors: parameters are pointed at views of them
            return torch.empty(shape, dtype=dtype, pin_memory=pin)

    def layer_flat(self, index: int, layer: nn.Module, version) -> torch.Tensor:
        """The layer's flat host buffer, refreshed from the layer's current weights when missing or stale."""
        flat = self.flats.get(index)
        if flat is not None and self._flat_versions.get(index) == version:
            return flat
        entries, nbytes = self.layouts[index]
        if flat is None:
            flat = self.flats[index] = self._empty((nbytes,), torch.uint8, nbytes)
        with torch.no_grad():
            for name, offset, shape, dtype in entries:
                source = layer.get_parameter(name).data
                target = view(flat, offset, shape, dtype)
                if source.data_ptr() != target.data_ptr():  # a streamed layer's weights already are these bytes
                    target.copy_(source, non_blocking=True)
        self._flat_versions[index] = version
        return flat

    def tensor(self, name: str, source: torch.Tensor, version) -> torch.Tensor:
        """The host copy of a non-layer tensor, refreshed from `source` when missing or stale."""
        copy = self.rest.get(name)
        if copy is not None and self._rest_versions.get(name) == version and copy.shape == source.shape:
            return copy
        if copy is None or copy.shape != source.shape or copy.dtype != source.dtype:
            copy = self.rest[name] = self._empty(source.shape, source.dtype, source.numel() * source.element_size())
        with torch.no_grad():
            if source.data_ptr() != copy.data_ptr():
                copy.copy_(source, non_blocking=True)
        self._rest_versions[name] = version
        return copy

    def mark_current(self, index: int, version) -> None:
        """A streamed layer's buffer was changed in place (a LoRA merge into a streamed block): it is the truth."""
        self._flat_versions[index] = version
