"""Layer streaming: run a stack of same-shaped layers (DiT blocks, text-encoder decoder layers) on a device that
cannot hold them all.

`LayerStreamer(layers, device)` keeps the first `resident` layers on the device. Each other layer lives in one
flat pinned host buffer; its parameters are views into one of two device staging slots (memory/prefetch.py),
which are refilled on a side stream while the layer before computes. The model calls `begin()` before its layer
loop and `before(i)` / `after(i)` around layer i (the DiT's loop does; `attach_hooks` does it for modules that
run through `forward`). Slot addresses never change, so a CUDA graph captured with streaming replays the copies
too; resident and streamed layers compute with the same kernels on the same values (bit-identical outputs).

While streaming, a streamed layer's parameters point at whatever its slot holds: only the layer loop may read
them. Anything else that reads or writes weights calls `set_resident` or `move_all` first (a move to another
device), or changes one layer at a time inside `editing(i)` (LoRA merges).

The host buffers belong to the module's `HostCopy` (memory/host_copy.py), kept for the life of the model: a layer
that stops streaming keeps its host buffer, so streaming it again, or moving the whole module off the GPU
(`place_with_streaming` to the CPU), copies nothing when the weights did not change since. A streamed layer's host
buffer is its only copy of the weights: it is never refreshed from the layer (whose parameters are slot views).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from .host_copy import HostCopy, layout, view
from .planner import indexed_device
from .prefetch import SlotPrefetcher

log = logging.getLogger(__name__)


class StreamableStack(Protocol):
    """What the memory managers (nodes/host.py) need from a model that can run with part of its layer stack on
    the device: the DiT (its blocks) and the text encoder (its decoder layers) both provide it."""

    @property
    def num_layers(self) -> int: ...

    @property
    def layer_bytes(self) -> int: ...

    def place(self, device, resident_layers: int | None = None) -> None: ...

    def device_weight_bytes(self) -> int: ...


def point_parameter(module: nn.Module, name: str, data: torch.Tensor) -> None:
    """Make parameter `name` of `module` hold `data`. A parameter created under inference mode (ComfyUI loads
    models inside it) is an inference tensor, and one given a normal tensor's data fails at its next use ("Inference
    tensors do not track version counter"): such a parameter is replaced by a new one instead."""
    param = module.get_parameter(name)
    if param.is_inference() == data.is_inference():
        param.data = data
        return
    replacement = nn.Parameter(data, requires_grad=False)
    for sub in module.modules():  # every owner, so tied weights stay tied
        for leaf, held in sub._parameters.items():
            if held is param:
                sub._parameters[leaf] = replacement


def move_layer(layer: nn.Module, device: torch.device) -> None:
    """layer.to(device) (asynchronous towards the GPU), except that a parameter made under inference mode is
    replaced rather than given the copy as its `.data` (point_parameter): `.to()` would leave it an inference tensor
    holding normal data, which fails at its first use outside inference mode (a branch loaded inside ComfyUI)."""
    device = torch.device(device)
    for name, param in list(layer.named_parameters()):
        point_parameter(layer, name, param.data.to(device, non_blocking=device.type == "cuda"))
    for sub in layer.modules():
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = buffer.to(device, non_blocking=device.type == "cuda")


def point_layer(layer: nn.Module, entries, flat: torch.Tensor, device: torch.device | None = None) -> None:
    """The layer's parameters as views of its flat host buffer, or as copies of them on `device` (asynchronous from
    pinned memory: the copies run in stream order before anything that reads them)."""
    for name, offset, shape, dtype in entries:
        data = view(flat, offset, shape, dtype)
        point_parameter(layer, name, data if device is None else data.to(device, non_blocking=True))


def layers_to_host(layers: list[nn.Module], home: HostCopy, version, streamed: dict | None = None) -> None:
    """Every layer as views of its host buffer: a streamed layer's buffer as it is (the only copy of its weights),
    the others refreshed from the layer where stale. Device copies are dropped."""
    streamed = streamed or {}
    with torch.no_grad(), torch.inference_mode(False):
        for index, layer in enumerate(layers):
            if index in streamed:
                home.mark_current(index, version)
                point_layer(layer, home.entries(index), streamed[index])
            else:
                point_layer(layer, home.entries(index), home.layer_flat(index, layer, version))
    _finish_host_copies()


class LayerStreamer:
    def __init__(self, layers: list[nn.Module], device: torch.device, slots: int = 2, home: HostCopy | None = None,
                 version=()):  # fmt: skip
        if not layers:
            raise ValueError("a streamer needs at least one layer")
        self.layers = list(layers)
        self.device = torch.device(device)
        self.layouts = [layout(layer) for layer in self.layers]  # layers may differ (GGUF block types per block)
        self.layer_bytes = max(nbytes for _, nbytes in self.layouts)  # a staging slot holds the largest
        self.slots = slots
        self.resident = len(self.layers)  # everything where it is until set_resident says otherwise
        self.home = home or HostCopy(self.layers, pin=self.device.type == "cuda")
        self.version = version  # of the weights (see HostCopy): the host buffers of an older one are refreshed
        self.host: dict[int, torch.Tensor] = {}  # streamed layer -> its host buffer (the home's)
        self.prefetcher: SlotPrefetcher | None = None

    # ---- placement -------------------------------------------------------------------------------------

    @property
    def streamed(self) -> list[int]:
        return sorted(self.host)

    @property
    def slot_bytes(self) -> int:
        return self.prefetcher.nbytes if self.prefetcher is not None else 0

    @property
    def device_bytes(self) -> int:
        """Device memory of the resident layers and the staging slots."""
        return self.resident * self.layer_bytes + self.slot_bytes

    def set_resident(self, count: int) -> None:
        """Keep layers [0, count) on the device and stream the rest (count is clamped to [0, len(layers)])."""
        count = max(0, min(len(self.layers), int(count)))
        with torch.no_grad(), torch.inference_mode(False):
            for index in range(count):
                if index in self.host:
                    self._make_resident(index)
                else:  # from wherever it was (an offloaded model's host copy: pinned, so asynchronous)
                    self.layers[index].to(self.device, non_blocking=self.device.type == "cuda")
            for index in range(count, len(self.layers)):
                if index not in self.host:
                    self._make_streamed(index)
            self.resident = count
            self._refresh_slots()
        log.info("layer streaming: %d of %d layers resident (%.2f GiB), %d streamed", count, len(self.layers),
                 count * self.layer_bytes / 2**30, len(self.host))  # fmt: skip

    def move_all(self, device: torch.device) -> None:
        """Every layer whole on `device` (no streaming); to the CPU, the layers become views of their host buffers
        (copied there first only where stale)."""
        device = torch.device(device)
        with torch.no_grad(), torch.inference_mode(False):
            if device.type == "cpu":
                layers_to_host(self.layers, self.home, self.version, streamed=self.host)
                self.host.clear()
            else:
                for index in list(self.host):
                    self._point_at(index, self.host.pop(index), device)
                for layer in self.layers:
                    move_layer(layer, device)
        self.prefetcher = None
        self.resident = len(self.layers) if device == self.device else 0

    def _point_at(self, index: int, flat: torch.Tensor, device: torch.device | None = None) -> None:
        point_layer(self.layers[index], self.layouts[index][0], flat, device)

    @contextmanager
    def editing(self, index: int):
        """Layer `index` with parameters of its own on the device for the block, its host copy updated from them
        after it, then back on its staging slot: for code that changes a streamed layer's weights in place (one
        layer's bytes of extra device memory). A layer that is not streamed is left as it is."""
        if index not in self.host:
            yield
            return
        layer, flat, entries = self.layers[index], self.host[index], self.layouts[index][0]
        with torch.no_grad(), torch.inference_mode(False):
            for name, offset, shape, dtype in entries:
                point_parameter(layer, name, view(flat, offset, shape, dtype).to(self.device, copy=True))
        try:
            yield
        finally:
            with torch.no_grad(), torch.inference_mode(False):
                for name, offset, shape, dtype in entries:
                    view(flat, offset, shape, dtype).copy_(layer.get_parameter(name))
                self.home.mark_current(index, self.version)
                self._refresh_slots()

    def _make_resident(self, index: int) -> None:
        self._point_at(index, self.host.pop(index), self.device)

    def _make_streamed(self, index: int) -> None:
        flat = self.home.layer_flat(index, self.layers[index], self.version)  # copies only when missing or stale
        for name, _offset, _shape, dtype in self.layouts[index][0]:
            # released here (the host buffer holds the values); pointed at its slot by _refresh_slots
            point_parameter(self.layers[index], name, torch.empty(0, dtype=dtype))
        self.host[index] = flat

    def _refresh_slots(self) -> None:
        """Point every streamed layer's parameters at its staging slot (position in the stream order % slots)."""
        if not self.host:
            self.prefetcher = None
            return
        if self.prefetcher is None:
            self.prefetcher = SlotPrefetcher(self.device, self.layer_bytes, min(self.slots, len(self.host)))
        self.prefetcher.set_items(self.host)
        for index in self.host:
            slot = self.prefetcher.buffers[self.prefetcher.slot_of(index)]
            for name, offset, shape, dtype in self.layouts[index][0]:
                point_parameter(self.layers[index], name, view(slot, offset, shape, dtype))

    # ---- the layer loop -----------------------------------------------------------------------------------

    def begin(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.begin()

    def before(self, index: int) -> None:
        if index in self.host:
            self.prefetcher.acquire(index)

    def after(self, index: int) -> None:
        if index in self.host:
            self.prefetcher.release(index)

    def attach_hooks(self, stack: nn.Module) -> list:
        """Drive the loop from forward hooks: `begin` before `stack` runs, before/after around each layer."""
        handles = [stack.register_forward_pre_hook(lambda *_: self.begin())]
        for index, layer in enumerate(self.layers):
            handles.append(layer.register_forward_pre_hook(lambda *_, i=index: self.before(i)))
            handles.append(layer.register_forward_hook(lambda *_, i=index: self.after(i)))
        return handles

    def detach_hooks(self) -> None:
        for handle in getattr(self, "hooks", []):
            handle.remove()
        self.hooks = []


def place_with_streaming(module: nn.Module, layers: nn.ModuleList, streamer: LayerStreamer | None, device,
                         resident: int | None, hooks_on: nn.Module | None = None, home: HostCopy | None = None,
                         version=()) -> LayerStreamer | None:  # fmt: skip
    """Put `module` on `device` with only `resident` of its `layers` there (the others streaming); resident None:
    everything whole on `device`. Returns the streamer now in use (None when not streaming). (On a CPU device the
    "streaming" copies within RAM: pointless in use, but the same bookkeeping, which the CPU tests check.)

    hooks_on: for modules that run their layers through forward (the text encoder), the stack to attach the
    streamer's hooks to; the DiT drives its streamer from its own loop.
    home, version: the module's host copy (memory/host_copy.py) and its weights' version. Given a home, moving to the
    CPU only points the weights at their host copy (refreshed where stale) and coming back copies from pinned
    memory; without one, `.to()` copies as torch does.
    """
    device = indexed_device(device)  # "cuda" and "cuda:0" must compare equal below, or the streamer is rebuilt
    to_host = device.type == "cpu" and home is not None
    if resident is None or resident >= len(layers):
        if streamer is not None:
            streamer.move_all("cpu" if to_host else device)
            streamer.detach_hooks()
        elif to_host:
            layers_to_host(list(layers), home, version)
        else:
            with torch.no_grad(), torch.inference_mode(False):
                for layer in layers:  # from the host copy (pinned): asynchronous
                    move_layer(layer, device)
        _place_rest(module, layers, device, home if to_host else None, version)
        return None
    _place_rest(module, layers, device, None, version)
    if streamer is None or streamer.device != device:
        if streamer is not None:
            streamer.move_all("cpu")
            streamer.detach_hooks()
        streamer = LayerStreamer(list(layers), device, home=home, version=version)
        if hooks_on is not None:
            streamer.hooks = streamer.attach_hooks(hooks_on)
    streamer.version = version
    streamer.set_resident(resident)
    return streamer


def _place_rest(module: nn.Module, layers: nn.ModuleList, device: torch.device, home: HostCopy | None,
                version) -> None:  # fmt: skip
    """The module's parameters and buffers outside `layers` on `device`: to the host copy when given one (views of
    it, refreshed where stale), else copied (asynchronously where the source is pinned)."""
    layer_tensors = {id(t) for layer in layers for t in (*layer.parameters(), *layer.buffers())}
    with torch.no_grad(), torch.inference_mode(False):
        for name, param in list(module.named_parameters()):
            if id(param) not in layer_tensors:
                point_parameter(module, name, _moved(param.data, name, device, home, version))
        for sub_name, sub in module.named_modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None and id(buffer) not in layer_tensors:
                    full = f"{sub_name}.{name}" if sub_name else name
                    sub._buffers[name] = _moved(buffer, full, device, home, version)
    if home is not None:
        _finish_host_copies()


def _moved(tensor: torch.Tensor, name: str, device: torch.device, home: HostCopy | None, version) -> torch.Tensor:
    if home is not None:
        return home.tensor(name, tensor, version)
    # asynchronous only towards the GPU: a device-to-pageable copy returns before its data is there
    return tensor.to(device, non_blocking=device.type == "cuda")


def _finish_host_copies() -> None:
    """Device-to-host copies into pinned memory are asynchronous: wait for them before the host reads the values
    (the device copies they came from are freed in stream order, which is safe either way)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
