"""Merge a stack of LoRAs into the transformer's weights in place, and take them out again exactly.

Why in place: the weights keep their addresses, so captured CUDA graphs (which read weights by address) stay valid
and replay the merged model, and a merged LoRA costs nothing per step. What depends on the weights' values, the
prefix K/V kept for reuse, is keyed on `transformer.weights_id`, which names the merged stack.

What a merge computes (`merge_into_weight`, and `MergingSlot` for a file's floats), in fp32 on the weight's
device:
- a float weight: W = round(W_orig + sum_i strength_i * alpha_i / rank_i * B_i @ A_i), rounded once to its dtype
  (the weights diffusers' fuse_lora gives);
- a quantised weight (quant/linear.py QuantLinear, fp8 or int8 with one scale per row), two ways:
  * from the file's float weight, when the transformer was loaded from a bf16 (fp16, fp32) file and quantised
    while loading: W_q = quantise(W_file + deltas), each checkpoint tensor quantised as the loader quantised it
    (so rows no LoRA touches come out bit-identical). One rounding, as quantising the merged model would give.
    The file is re-read and merged in one pass of the loader's reader (load_into into MergingSlots: the reads
    overlap the merges on the device), for every weight of the change at once;
  * otherwise (a quantised file, a model built in memory) from the loaded values: the rows a LoRA touches are
    dequantised, the deltas added and the rows requantised in the layer's own format (a new per-row scale); rows
    no LoRA touches keep their bits. int8_convrot stores W H (H the Hadamard rotation), so the sum is formed
    there: W H + B (A H), rotating the small down-projection A instead of the weight. The loaded values already
    carry the format's rounding, so the merged weight carries two: on weights alone about twice the error energy
    of the format without a LoRA (bench_lora measures it per layer and end to end).
  Either way the format's error stays the kind it is without a LoRA, and the work goes in row chunks (at most
  one layer in fp32 beside the weights).
A LoRA on a GGUF layer (quant/gguf_linear.py) always runs beside it: its blocks are never requantised.
A LoRA loaded with side_path=True (the LoRA node's mode "side_path") is not merged into a quantised weight:
it runs beside it as a low-rank product (QuantLinear.set_side_paths), exact up to the activations' dtype, at the
cost of extra GEMMs each step. On float weights a merge is already exact to one rounding, so both modes merge.

Exactness of removal: each weight a stack touches is first brought back to its original bits, then merged.
Removing every LoRA restores the original bits; changing a strength or a LoRA recomputes from them (no rounding
accumulates). A weight whose pieces did not change is left alone. The originals come from one of:

- `FileOriginals`: the checkpoint the transformer was loaded from, re-read through the loader's own code (the same
  renaming, dequantisation and quantisation, so the same bits: a bf16 file quantised at load is quantised again
  the same way, an fp8_scaled or int8_convrot file's rows are copied as they are). Holds no memory; the file
  must not change while it is in use.
- `MemoryOriginals`: copies of each weight, taken before it is first changed and dropped once it is back to its
  original, packed into a few large buffers per change. Where they go is the memory planner's decision
  (memory/planner.py copies_place, with the pipeline's VRAM budget): on the GPU while they take at most half of
  its free memory (restoring is then a copy within the device), else in pinned host RAM (pinning costs about a
  second per GB, once per change that touches new weights), else pageable. Memory: the bytes of the weights the
  current stack touches (a quantised layer's 8-bit values and scales); for a LoRA on every block linear of the
  full-size model that is all block weights, ~13 GiB in bf16, ~6.6 GiB quantised. For models built in memory.

Speed (a change takes a few passes over the touched weights, no per-weight waits): a LoRA's factors go to the
device before the merges (on_device), the range checks are read once per group (Checks), and the seconds of each
phase are in LoraMerger.last_stats (bench_lora prints them).

Blocks that stream from pinned host RAM (memory/streaming.py) are changed one at a time, each brought onto the
device for it and written back to its host copy: a streamed block's parameters otherwise point at a staging
slot that the next pass refills.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ...kernels.quantize_rows import rotate
from ..checkpoints import formats, key_maps
from ..checkpoints.files import Checkpoint, converted_shapes, identify, load_into
from ..dit.transformer import QwenImage21Transformer
from ..memory.host_copy import view as flat_view
from ..memory.planner import copies_place
from ..quant.gguf_linear import GGUFLinear
from ..quant.linear import QuantLinear
from ..quant.slots import QuantSlot, StoredQuant
from ..quant.weights import dequantize_weight, quantize_weight
from .reading import LoraError, LoraFile, LoraLayer

log = logging.getLogger(__name__)

Stack = Sequence[tuple[LoraFile, float]]  # (LoRA, strength), applied together
# Elements of a weight merged at once: each fp32 temporary of a merge (the weight, a delta, the requantisation's)
# is 64 MiB at most, whatever the layer's shape.
CHUNK_ELEMENTS = 2**24
_ALIGN = 256  # bytes: where each kept copy starts in its buffer (any dtype's alignment)
QUANTIZED_WEIGHT = "qweight"  # a quantised layer's weight parameter; its scales are in "weight_scale" beside it


@dataclass(frozen=True)
class LayerSlot:
    """Where one LoRA-addressable layer's weight lives: rows of one weight (the fused ones hold several).

    param: a float parameter ("transformer_blocks.0.attn.to_qkv.weight" for "transformer_blocks.0.attn.to_k"), or
    a quantised layer's "<layer>.qweight" (its weight_scale changes with it)."""

    param: str
    rows: slice
    shape: tuple[int, ...]


def _block_of(name: str) -> int | None:
    match = re.match(r"transformer_blocks\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def weight_slots(transformer: QwenImage21Transformer) -> dict[str, tuple[str, slice]]:
    """Checkpoint key of every weight -> (the parameter or quantised layer's qweight holding it, its rows there).

    Found by address within the key's own block: a streamed block's parameters are views into one staging buffer,
    and blocks sharing a staging slot share addresses, so a search over the whole model would be ambiguous."""
    params = dict(transformer.named_parameters())
    modules = {id(module): name for name, module in transformer.named_modules()}
    by_block = defaultdict(dict)
    for name, param in params.items():
        by_block[_block_of(name)][name] = param
    out = {}
    for key, slot in transformer.checkpoint_slots().items():
        if isinstance(slot, QuantSlot):
            out[key] = (f"{modules[id(slot.layer)]}.{QUANTIZED_WEIGHT}", slot.rows)
            continue
        start = slot.data_ptr()
        for name, param in by_block[_block_of(key)].items():
            offset = start - param.data_ptr()
            if 0 <= offset < param.numel() * param.element_size() and slot.dtype == param.dtype:
                row_bytes = (param.shape[1] if param.dim() == 2 else 1) * param.element_size()
                first = offset // row_bytes
                out[key] = (name, slice(first, first + slot.shape[0]))
                break
        else:
            raise RuntimeError(f"no parameter of the transformer holds checkpoint tensor {key}")
    return out


def lora_layers(transformer: QwenImage21Transformer) -> dict[str, LayerSlot]:
    """Every layer a LoRA may name (checkpoint names without `.weight`, plus the fused to_qkv and gate_up)."""
    slots = transformer.checkpoint_slots()
    layers = {}
    for key, (param, rows) in weight_slots(transformer).items():
        if key.endswith(".weight"):
            layers[key.removesuffix(".weight")] = LayerSlot(param, rows, tuple(slots[key].shape))
    for i, block in enumerate(transformer.transformer_blocks):
        for layer in ("attn.to_qkv", "img_mlp.gate_up"):
            linear = block.get_submodule(layer)
            name = f"transformer_blocks.{i}.{layer}"
            param = f"{name}.{QUANTIZED_WEIGHT}" if isinstance(linear, QuantLinear) else f"{name}.weight"
            shape = (linear.out_features, linear.in_features)
            layers[name] = LayerSlot(param, slice(0, shape[0]), shape)
    return layers


def layer_shapes(transformer: QwenImage21Transformer) -> dict[str, tuple[int, ...]]:
    """Layer name -> weight shape: what reading.read_lora checks a file against."""
    return {name: slot.shape for name, slot in lora_layers(transformer).items()}


# The weights id while a stack change is under way, and after one whose undo failed: no stack's identity (a tuple of
# tuples) equals it, so nothing keyed on the weights matches half-merged ones, and the next apply restores first.
CHANGING = ("qwen21: weights being changed",)


def stack_identity(stack: Stack) -> tuple:
    """What a merged stack is, for caches keyed on the weights: file identities, strengths and modes, in order."""
    return tuple((lora.identity, float(strength), lora.side_path) for lora, strength in stack if strength != 0)


def _is_quantized(target: str) -> bool:
    return target.endswith(f".{QUANTIZED_WEIGHT}")


def parameters_of(target: str) -> list[str]:
    """The parameters a merge into `target` (a LayerSlot.param) changes."""
    if _is_quantized(target):
        return [target, target.removesuffix(QUANTIZED_WEIGHT) + "weight_scale"]
    return [target]


@contextmanager
def full_fp32_matmul():
    """fp32 products at full precision even where the host turned TF32 on (ComfyUI can): deltas are fp32."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = saved


# ---------------------------------------------------------------------------------------------------------
# The merge of one weight
# ---------------------------------------------------------------------------------------------------------

Pieces = Sequence[tuple[slice, float, LoraLayer]]  # (rows of the weight, strength, the LoRA's layer)
FloatRows = list[tuple[slice, torch.Tensor]]  # a weight's original rows in fp32, one part per checkpoint tensor


def _touched_ranges(pieces: Pieces) -> list[tuple[int, int]]:
    """The row ranges some piece covers, overlapping and adjacent ones joined."""
    ranges = []
    for start, stop in sorted((rows.start, rows.stop) for rows, _, _ in pieces):
        if ranges and start <= ranges[-1][1]:
            ranges[-1] = (ranges[-1][0], max(ranges[-1][1], stop))
        else:
            ranges.append((start, stop))
    return ranges


class _Delta:
    """One piece's strength * alpha/rank * B @ A (or strength * diff), in fp32, for any rows of it, in the basis the
    weight is stored in (rotated by `rotation` for ConvRot: B (A H), H applied to the rank rows of A only)."""

    def __init__(self, layer: LoraLayer, strength: float, device, rotation: int):
        self.layer, self.strength, self.device, self.rotation = layer, strength, device, rotation
        self.down = None
        if layer.diff is None:
            down = layer.down.to(device, torch.float32)
            self.down = rotate(down, rotation) if rotation else down

    def rows(self, rows: slice) -> torch.Tensor:
        if self.layer.diff is not None:
            diff = self.layer.diff[rows].to(self.device, torch.float32, copy=True)  # never the LoRA's own tensor
            return (rotate(diff, self.rotation) if self.rotation else diff).mul_(self.strength)
        up = self.layer.up[rows].to(self.device, torch.float32)
        return (up @ self.down).mul_(self.layer.scale * self.strength)


def on_device(pieces: Pieces, device) -> list[tuple[slice, float, LoraLayer]]:
    """The pieces with their LoRA factors copied to `device` (as stored), before a merge starts: a copy from pageable
    host memory waits for the device's queued work, so made inside a merge it would stall the file reads that
    overlap it. A full difference (.diff, the weight's size) stays where it is and goes over rows at a time."""
    out = []
    for rows, strength, layer in pieces:
        if layer.diff is None:
            layer = replace(layer, up=layer.up.to(device), down=layer.down.to(device))
        out.append((rows, strength, layer))
    return out


class Checks:
    """The merges' range checks (NaN/inf from a file, beyond a float weight's range), gathered on the device and
    read once at the end: reading a device value waits for all queued work, once per chunk it would serialise the
    merges with the file reads. A failed check raises after the values were written; the caller restores them."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, torch.dtype | None, str]] = []

    def add(self, merged: torch.Tensor, dtype: torch.dtype | None, names: str) -> None:
        self.pending.append((merged.abs().amax().float(), dtype, names))

    def verify(self) -> None:
        if not self.pending:
            return
        device = self.pending[0][0].device
        largest = torch.stack([value.to(device) for value, _, _ in self.pending]).tolist()  # the one sync
        pending, self.pending = self.pending, []
        for value, (_, dtype, names) in zip(largest, pending, strict=True):
            if dtype is None and not math.isfinite(value):
                raise LoraError(f"merging into {names} gives {value:g}: check the LoRA file (or lower the strength)")
            if dtype is not None and not value <= torch.finfo(dtype).max:
                raise LoraError(
                    f"merging into {names} gives {value:g}, beyond {dtype} (max {torch.finfo(dtype).max:g}): lower "
                    "the strength or check the LoRA file"
                )


def _names(pieces: Pieces) -> str:
    return ", ".join(sorted({layer.layer for _, _, layer in pieces}))


@torch.no_grad()
def merge_into_weight(target: torch.Tensor | QuantLinear, pieces: Pieces, checks: Checks | None = None) -> None:
    """Apply the LoRA pieces of one weight in place, from its values on entry (its original values; see the module
    docstring for the arithmetic).

    `target` is a float parameter or a QuantLinear. The rows the pieces touch are processed in chunks of
    CHUNK_ELEMENTS: read in fp32 (dequantised, in the stored basis), the pieces' deltas added in order, and written
    back (rounded once, or requantised per row). The range checks go to `checks` (verified by the caller), or are
    verified before returning.
    """
    verify_here = checks is None
    checks = Checks() if checks is None else checks
    quantized = isinstance(target, QuantLinear)
    stored = target.qweight if quantized else target
    rotation = target.fmt.rotation if quantized else 0
    deltas = [(rows, _Delta(layer, strength, stored.device, rotation)) for rows, strength, layer in pieces]
    names = _names(pieces)
    step = max(1, CHUNK_ELEMENTS // (stored.shape[1] if stored.dim() == 2 else 1))
    for first, last in _touched_ranges(pieces):
        for start in range(first, last, step):
            chunk = slice(start, min(start + step, last))
            if quantized:
                merged = dequantize_weight(target.qweight[chunk], target.weight_scale[chunk], 0, torch.float32)
            else:
                merged = target[chunk].to(torch.float32, copy=True)
            for rows, delta in deltas:
                lo, hi = max(chunk.start, rows.start), min(chunk.stop, rows.stop)
                if lo < hi:
                    merged[lo - chunk.start : hi - chunk.start] += delta.rows(slice(lo - rows.start, hi - rows.start))
            checks.add(merged, None if quantized else target.dtype, names)
            if quantized:
                q, scale = quantize_weight(merged, target.fmt, rotated=True)
                target.qweight[chunk].copy_(q)
                target.weight_scale[chunk].copy_(scale)
            else:
                target[chunk].copy_(merged)
    if verify_here:
        checks.verify()


class MergingSlot(QuantSlot):
    """Rows of a quantised layer as a destination for the loader (checkpoints/files.py load_into): the file's float
    tensor for them arrives, the deltas of the pieces on these rows are added in fp32 and the sum is quantised as
    the loader quantises a float tensor. So re-reading and merging are one pass over the file, and the merged
    weight carries one rounding. Rows no piece touches come out as loaded."""

    def __init__(self, layer: QuantLinear, rows: slice, pieces: Pieces, checks: Checks, names: str):
        super().__init__(layer, rows.start, rows.stop)
        self.pieces, self.checks, self.names = list(pieces), checks, names

    @torch.no_grad()
    def fill(self, tensor: torch.Tensor, stored: StoredQuant | None = None) -> None:
        if stored is not None:
            raise RuntimeError(f"{self.names}: merging from floats got rows the file stores quantised")
        weight = tensor.to(self.device, torch.float32, copy=True)  # fp32 [rows, K], ours to change
        deltas = [(rows, _Delta(layer, strength, self.device, 0)) for rows, strength, layer in self.pieces]
        step = max(1, CHUNK_ELEMENTS // weight.shape[1])
        part = self.rows
        for rows, delta in deltas:
            lo, hi = max(part.start, rows.start), min(part.stop, rows.stop)
            for start in range(lo, hi, step):
                stop = min(start + step, hi)
                weight[start - part.start : stop - part.start] += delta.rows(slice(start - rows.start,
                                                                                   stop - rows.start))  # fmt: skip
        self.checks.add(weight, None, self.names)
        super().fill(weight)  # the loader's own quantisation of a float tensor
        self.pieces = []  # its deltas' device memory goes as the load moves on


def attach_side_paths(layer: QuantLinear, pieces: Pieces) -> None:
    """A quantised layer's LoRA kept beside its weight (strength and alpha/rank folded into up); [] removes it."""
    paths = []
    for rows, strength, lora_layer in pieces:
        if lora_layer.diff is not None:
            remedy = ("GGUF weights take LoRAs (low-rank factors) only" if isinstance(layer, GGUFLinear)
                      else "use the LoRA node's mode merge for this file")  # fmt: skip
            raise LoraError(f"{lora_layer.layer}: a full-difference (.diff) patch cannot run as a side path beside "
                            f"a quantised weight; {remedy}")  # fmt: skip
        up = lora_layer.up.to(layer.qweight.device, torch.float32) * (lora_layer.scale * strength)
        paths.append((rows, lora_layer.down, up))
    layer.set_side_paths(paths)


# ---------------------------------------------------------------------------------------------------------
# Where the original weights come from
# ---------------------------------------------------------------------------------------------------------


class MemoryOriginals:
    """Copies of the parameters a stack changes, taken before their first change (see the module docstring).

    The copies of one change are packed into a few large buffers (SLAB_BYTES each) made at once, where the memory
    planner puts them (memory/planner.py copies_place): on the weights' device when it has room for them, else in
    pinned host RAM (copies at the bus's rate; torch rounds each pinned allocation up to a power of two, so slabs
    of one power of two waste nothing), else pageable. The copies are queued on the weights' stream, ahead of the
    merges that change the weights; nothing waits for them. A slab is freed once none of its copies is needed."""

    SLAB_BYTES = 2**30

    def __init__(self):
        self.saved: dict[str, torch.Tensor] = {}
        self.place = "none"  # where the last copies went

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

    @contextmanager
    def reading(self):
        yield

    def keep(self, params: dict[str, torch.Tensor], vram_budget: int | None = None) -> None:
        by_device = defaultdict(dict)
        for name, param in params.items():
            if name not in self.saved:
                by_device[param.device][name] = param
        for device, new in by_device.items():
            sizes = {name: -(-param.numel() * param.element_size() // _ALIGN) * _ALIGN for name, param in new.items()}
            self.place = copies_place(sum(sizes.values()), device, vram_budget)
            # ordinary tensors, usable whatever the caller's mode (inference_mode(False) turns grad on: off again)
            with torch.inference_mode(False), torch.no_grad():
                for names, nbytes in _slabs(sizes, self.SLAB_BYTES):
                    slab = torch.empty(nbytes, dtype=torch.uint8, device=device if self.place == "device" else "cpu",
                                       pin_memory=self.place == "pinned")  # fmt: skip
                    offset = 0
                    for name in names:
                        param = new[name]
                        copy = flat_view(slab, offset, param.shape, param.dtype)
                        self.saved[name] = copy.copy_(param, non_blocking=True)
                        offset += sizes[name]

    def restore(self, transformer: QwenImage21Transformer, names: Iterable[str]) -> None:
        for name in names:
            transformer.get_parameter(name).copy_(self.saved[name], non_blocking=True)

    def stores_floats(self, transformer: QwenImage21Transformer, target: str) -> bool:
        return False  # a model built in memory: its float weights are gone once quantised

    def keep_only(self, names: Iterable[str]) -> None:
        names = set(names)
        self.saved = {name: saved for name, saved in self.saved.items() if name in names}


def _slabs(sizes: dict[str, int], slab_bytes: int) -> list[tuple[list[str], int]]:
    """Names packed in order into buffers of at most `slab_bytes` (a larger one alone): [(names, bytes)]."""
    slabs: list[tuple[list[str], int]] = []
    for name, nbytes in sizes.items():
        if slabs and slabs[-1][1] + nbytes <= slab_bytes:
            slabs[-1] = (slabs[-1][0] + [name], slabs[-1][1] + nbytes)
        else:
            slabs.append(([name], nbytes))
    return slabs


class FileOriginals:
    """Re-reads original weights from the checkpoint the transformer was loaded from (see the module docstring)."""

    nbytes = 0

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.stamp = self._stamp()
        self._session: _FileSession | None = None  # the open checkpoint while `reading`

    def _stamp(self) -> tuple:
        with Checkpoint.open(self.path) as ckpt:
            files = sorted({info.file for info in ckpt.tensors.values()} | {ckpt.path})
        return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)

    @contextmanager
    def reading(self):
        """The checkpoint opened once (on first use) for all the reads of one stack change."""
        try:
            yield
        finally:
            if self._session is not None:
                self._session.ckpt.close()
                self._session = None

    def _open(self, transformer: QwenImage21Transformer) -> _FileSession:
        if self._session is None:
            if self._stamp() != self.stamp:
                raise LoraError(
                    f"{self.path} changed on disk since the model was loaded, so the weights without the LoRA "
                    "cannot be re-read from it; load the model again"
                )
            self._session = _FileSession(Checkpoint.open(self.path), transformer)
        return self._session

    def keep(self, params: dict[str, torch.Tensor], vram_budget: int | None = None) -> None:
        pass  # the file has them

    def keep_only(self, names: Iterable[str]) -> None:
        pass

    def restore(self, transformer: QwenImage21Transformer, names: Iterable[str]) -> None:
        names = set(names)
        if names:
            session = self._open(transformer)
            model_slots = transformer.checkpoint_slots()
            session.read({key: model_slots[key] for key, (holder, _) in session.holders.items() if holder in names})

    def stores_floats(self, transformer: QwenImage21Transformer, target: str) -> bool:
        """Whether the file stores the float weight of quantised layer `target` (a bf16 file quantised at load)."""
        session = self._open(transformer)
        return all(session.produced[key][0] not in session.quant.layers for key in session.keys_of(target))

    def merge_floats(self, transformer: QwenImage21Transformer, merges: dict[str, Pieces], checks: Checks) -> None:
        """Quantised weights (targets whose float weights the file stores) re-read from the file with their pieces'
        deltas added, each checkpoint tensor quantised as the loader quantised it (MergingSlot): one pass through
        the loader's reader for all of them, and every row rewritten, so no restore comes first."""
        session = self._open(transformer)
        slots = {}
        for target, pieces in merges.items():
            layer = transformer.get_submodule(target.removesuffix(f".{QUANTIZED_WEIGHT}"))
            names = _names(pieces)
            for key in session.keys_of(target):
                rows = session.holders[key][1]
                touching = [piece for piece in pieces if piece[0].start < rows.stop and rows.start < piece[0].stop]
                slots[key] = MergingSlot(layer, rows, touching, checks, names)
        session.read(slots)


class _FileSession:
    """An open checkpoint with what reading from it needs: its key converter, quantisation scheme, the names
    it produces, and which of our weights each of them fills."""

    def __init__(self, ckpt: Checkpoint, transformer: QwenImage21Transformer):
        self.ckpt = ckpt
        self.convert = key_maps.converter(identify(ckpt, "transformer"), ckpt.keys())
        self.quant = formats.inspect(str(ckpt.path), ckpt.keys(), ckpt.dtype, ckpt.metadata, ckpt.read)
        self.produced = converted_shapes(ckpt, self.convert, self.quant)  # our key -> (file key, shape)
        self.holders = weight_slots(transformer)  # our key -> (weight holding it, rows there)

        self.targets = defaultdict(list)  # weight -> our keys it holds
        for key, (holder, _) in self.holders.items():
            self.targets[holder].append(key)

    def keys_of(self, target: str) -> list[str]:
        return self.targets[target]

    def read(self, slots: dict) -> None:
        """Fill the given slots (our key -> a model slot or any tensor of its shape) from the file; nothing else
        is read."""
        load_into(dict.fromkeys(self.produced) | slots, self.ckpt, self.convert, what="original weights (LoRA)",
                  quant=self.quant, quiet=True, produced=self.produced)  # fmt: skip


def originals_for(transformer_path: str | os.PathLike | None) -> FileOriginals | MemoryOriginals:
    """Re-read from the transformer's checkpoint when it came from one, else keep CPU copies."""
    if transformer_path is not None and Path(transformer_path).exists():
        return FileOriginals(transformer_path)
    return MemoryOriginals()


# ---------------------------------------------------------------------------------------------------------
# Bringing the weights to a stack
# ---------------------------------------------------------------------------------------------------------


class LoraMerger:
    """Keeps track of what is applied to one transformer and brings its weights to any requested stack."""

    def __init__(self, transformer: QwenImage21Transformer, originals: FileOriginals | MemoryOriginals):
        self.transformer = transformer
        self.originals = originals
        self.merged: dict[str, tuple] = {}  # weight (LayerSlot.param) -> the pieces applied to it now
        self.changed: set[str] = set()  # weights whose values differ from the originals (a side path changes none)
        self.stack_id: tuple = ()
        self.last_stats: dict = {}

    @torch.no_grad()
    def apply(self, stack: Stack, vram_budget: int | None = None) -> None:
        """Make the weights original + `stack` (an empty stack restores the original weights).

        vram_budget: the pipeline's device budget (bytes), which decides with the memory planner whether copies
        of the original weights (MemoryOriginals) may stay on the device."""
        stack_id = stack_identity(stack)
        if stack_id == self.stack_id:
            return
        if self.stack_id == CHANGING:  # an earlier change and its undo both failed: start from the originals
            self._restore_all()
            self._set_id(())
        started = time.perf_counter()
        plan = self._plan(stack)
        wanted = {target: tuple((lora_id, s, layer.layer, side) for _, s, layer, side, lora_id in pieces)
                  for target, pieces in plan.items()}  # fmt: skip
        changed = {t for t in set(self.merged) | set(wanted) if self.merged.get(t) != wanted.get(t)}
        counts = {"weights_merged": 0, "side_paths": 0}
        clock = _PhaseClock(self.transformer.device)
        was_changed = set(self.changed)
        self._set_id(CHANGING)  # until the change is complete no stack's id names these weights
        try:
            with self.originals.reading(), full_fp32_matmul():
                for names, place in self._groups(changed):
                    with place:
                        self._bring(names, plan, wanted, counts, clock, vram_budget)
            self.originals.keep_only(p for target in self.changed for p in parameters_of(target))
        except BaseException:
            self._restore_all()  # never leave a half-merged model behind (if this fails too, CHANGING stays)
            self._set_id(())
            raise
        self._set_id(stack_id)
        counts["weights_restored"] = len(was_changed - self.changed)  # back to the original and left there
        if self.transformer.device.type == "cuda":
            torch.cuda.synchronize(self.transformer.device)
        self.last_stats = {"seconds": round(time.perf_counter() - started, 3), **counts,
                           "original_copies_mib": round(self.originals.nbytes / 2**20, 1),
                           "originals_on": getattr(self.originals, "place", "file"), **clock.rounded()}  # fmt: skip
        log.info("LoRA stack %s applied: %s", [lora.path.name for lora, _ in stack], self.last_stats)

    def _bring(self, names: set[str], plan: dict, wanted: dict, counts: dict, clock: _PhaseClock,
               vram_budget: int | None) -> None:  # fmt: skip
        """Bring the weights `names` (one group of _groups, in place) from what they hold to what `wanted` says."""
        targets = sorted(names & set(wanted))
        # a GGUF layer's blocks are never requantised: every LoRA on it runs beside it
        beside_only = {name for name in targets if _is_quantized(name) and isinstance(self._layer(name), GGUFLinear)}
        merges = {}  # weight -> the pieces merged into it (a quantised weight's side paths are not)
        for name in targets:
            pieces = [(rows, s, layer) for rows, s, layer, side, _ in plan[name]
                      if not ((side or name in beside_only) and _is_quantized(name))]  # fmt: skip
            if pieces:
                merges[name] = pieces
        # weights re-merged from the file's floats need no restore first (every row is rewritten)
        from_floats = {n for n in merges if _is_quantized(n) and self.originals.stores_floats(self.transformer, n)}
        with clock("restore_s"):
            self._restore(names & set(self.merged), keep=from_floats)
        for name in targets:
            if _is_quantized(name):
                beside = [(rows, s, layer) for rows, s, layer, side, _ in plan[name] if side or name in beside_only]
                attach_side_paths(self._layer(name), beside)
                counts["side_paths"] += int(bool(beside))
            self.merged[name] = wanted[name]  # from here on a failure takes it off again
        if not merges:
            return
        device = self.transformer.get_parameter(next(iter(merges))).device
        with clock("lora_to_device_s"):
            merges = {name: on_device(pieces, device) for name, pieces in merges.items()}
        with clock("keep_originals_s"):
            self.originals.keep({p: self.transformer.get_parameter(p) for name in merges for p in parameters_of(name)},
                                vram_budget)  # fmt: skip
        self.changed |= set(merges)  # before the merges: a failure half way through is undone too
        checks = Checks()
        with clock("file_read_and_merge_s"):
            if from_floats:
                self.originals.merge_floats(self.transformer, {n: merges[n] for n in sorted(from_floats)}, checks)
        with clock("merge_s"):
            for name in sorted(set(merges) - from_floats):
                target = self._layer(name) if _is_quantized(name) else self.transformer.get_parameter(name)
                merge_into_weight(target, merges[name], checks)
        with clock("check_s"):
            checks.verify()
        counts["weights_merged"] += len(merges)

    def _layer(self, name: str) -> QuantLinear:
        return self.transformer.get_submodule(name.removesuffix(f".{QUANTIZED_WEIGHT}"))

    def _plan(self, stack: Stack) -> dict[str, list]:
        layers = lora_layers(self.transformer)
        plan = defaultdict(list)
        for lora, strength in stack:
            if strength == 0:
                continue
            for layer in lora.layers:
                slot = layers.get(layer.layer)
                expected = None if slot is None else slot.shape
                shape = tuple(layer.diff.shape) if layer.diff is not None else (layer.up.shape[0], layer.down.shape[1])
                if shape != expected:
                    raise LoraError(f"LoRA {lora.path.name} was read for another model: {layer.layer} is "
                                    f"{list(shape)} there, {expected} here")  # fmt: skip
                plan[slot.param].append((slot.rows, float(strength), layer, lora.side_path, lora.identity))
        return plan

    def _groups(self, names: set[str]) -> Iterator[tuple[set[str], contextlib.AbstractContextManager]]:
        """`names` split into what is changed together: every weight outside streamed blocks first, then each
        streamed block's, with that block on the device meanwhile (memory/streaming.py LayerStreamer.editing)."""
        streamer = self.transformer.streamer
        streamed = set(streamer.streamed) if streamer is not None else set()
        groups = defaultdict(set)
        for name in names:
            block = _block_of(name)
            groups[block if block in streamed else None].add(name)
        if groups.get(None):
            yield groups.pop(None), contextlib.nullcontext()
        for block in sorted(groups):
            yield groups[block], streamer.editing(block)

    def _restore(self, names: set[str], keep: set[str] = frozenset()) -> None:
        """Side paths off and the original values back for `names`, except the values of `keep` (about to be
        rewritten whole)."""
        for name in names:
            if _is_quantized(name):
                self._layer(name).set_side_paths([])
        weights = sorted((names & self.changed) - keep)
        self.originals.restore(self.transformer, [p for target in weights for p in parameters_of(target)])
        self.changed -= names - keep
        for name in names:
            self.merged.pop(name, None)

    def _restore_all(self) -> None:
        with self.originals.reading():
            for names, place in self._groups(set(self.merged) | self.changed):
                with place:
                    self._restore(names)

    def _set_id(self, stack_id: tuple) -> None:
        self.stack_id = stack_id
        self.transformer.weights_id = stack_id


class _PhaseClock:
    """Seconds per phase of one stack change, summed over the groups (where the time goes, for the benchmark). On
    CUDA each phase ends with a synchronisation, so the device work it queued counts in it: a few per change."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[phase] += time.perf_counter() - start

    def rounded(self) -> dict[str, float]:
        return {phase: round(seconds, 3) for phase, seconds in self.seconds.items()}
