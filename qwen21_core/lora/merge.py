"""Merge a stack of LoRAs into the transformer's weights in place, and take them out again exactly.

Why in place: the weights keep their addresses, so captured CUDA graphs (which read weights by address) stay valid
and replay the merged model, and a merged LoRA costs nothing per step. What depends on the weights' values, the
prefix K/V kept for reuse, is keyed on `transformer.weights_id`, which names the merged stack.

Exactness: each weight a stack touches is first brought back to its original bits, then
W = round(W_orig + sum_i strength_i * alpha_i / rank_i * B_i @ A_i) is computed in fp32 and rounded once to the
weight's dtype. Removing every LoRA restores the original bits; changing a strength recomputes from them. A weight
whose pieces did not change is left alone. The originals come from one of:

- `FileOriginals`: the checkpoint the transformer was loaded from, re-read through the loader's own code (the same
  renaming and dequantisation, so the same bits). Holds no memory; the file must not change while it is in use.
- `MemoryOriginals`: CPU copies (pinned for CUDA) of each weight, taken before it is first changed and dropped once
  it is back to its original. Memory: the bytes of the weights the current stack touches; for a LoRA on every block
  linear of the full-size model that is all block weights, ~13 GiB in bf16. For models built in memory.
"""

from __future__ import annotations

import logging
import os
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints import key_maps
from ..checkpoints.files import Checkpoint, identify, load_into
from ..dit.transformer import QwenImage21Transformer
from .reading import LoraError, LoraFile, LoraLayer

log = logging.getLogger(__name__)

Stack = Sequence[tuple[LoraFile, float]]  # (LoRA, strength), applied together


@dataclass(frozen=True)
class LayerSlot:
    """Where one LoRA-addressable layer's weight lives: rows of one parameter (the fused ones hold several)."""

    param: str  # e.g. "transformer_blocks.0.attn.to_qkv.weight" for the layer "transformer_blocks.0.attn.to_k"
    rows: slice
    shape: tuple[int, ...]


def lora_layers(transformer: QwenImage21Transformer) -> dict[str, LayerSlot]:
    """Every layer a LoRA may name (checkpoint names without `.weight`, plus the fused to_qkv and gate_up)."""
    params = dict(transformer.named_parameters())
    owners = {param.untyped_storage().data_ptr(): name for name, param in params.items()}
    layers = {}
    for key, slot in transformer.checkpoint_slots().items():
        if not key.endswith(".weight"):
            continue
        name = owners[slot.untyped_storage().data_ptr()]
        row = params[name].shape[1] if params[name].dim() == 2 else 1
        start = (slot.storage_offset() - params[name].storage_offset()) // row
        layers[key.removesuffix(".weight")] = LayerSlot(name, slice(start, start + slot.shape[0]), tuple(slot.shape))
    for i, block in enumerate(transformer.transformer_blocks):
        fused = {"attn.to_qkv": block.attn.to_qkv.weight, "img_mlp.gate_up": block.img_mlp.gate_up.weight}
        for layer, weight in fused.items():
            name = f"transformer_blocks.{i}.{layer}"
            layers[name] = LayerSlot(f"{name}.weight", slice(0, weight.shape[0]), tuple(weight.shape))
    return layers


def layer_shapes(transformer: QwenImage21Transformer) -> dict[str, tuple[int, ...]]:
    """Layer name -> weight shape: what reading.read_lora checks a file against."""
    return {name: slot.shape for name, slot in lora_layers(transformer).items()}


def stack_identity(stack: Stack) -> tuple:
    """What a merged stack is, for caches keyed on the weights: file identities and strengths, in order."""
    return tuple((lora.identity, float(strength)) for lora, strength in stack if strength != 0)


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


@torch.no_grad()
def merge_into_weight(weight: torch.Tensor, pieces: Sequence[tuple[slice, float, LoraLayer]]) -> None:
    """Apply the LoRA pieces of one parameter in place: W = round(W + sum strength * delta), in fp32, one rounding.

    `weight` holds its original values on entry; each piece is (rows of the parameter, strength, layer). Every
    change to a weight goes through here: a quantized layer would branch here to keep the factors as a low-rank
    side path instead of merging.
    """
    merged = weight.to(torch.float32, copy=True)
    for rows, strength, layer in pieces:
        merged[rows] += layer.delta(weight.device, strength)
    largest = float(merged.abs().amax())  # one sync per weight; catches NaN/inf in a file and fp16 overflow
    if not largest <= torch.finfo(weight.dtype).max:
        names = sorted({layer.layer for _, _, layer in pieces})
        raise LoraError(
            f"merging into {', '.join(names)} gives {largest:g}, beyond {weight.dtype} "
            f"(max {torch.finfo(weight.dtype).max:g}): lower the strength or check the LoRA file"
        )
    weight.copy_(merged)


# ---------------------------------------------------------------------------------------------------------
# Where the original weights come from
# ---------------------------------------------------------------------------------------------------------


class MemoryOriginals:
    """CPU copies of the weights a stack touches, taken before their first change (see the module docstring)."""

    def __init__(self):
        self.saved: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.saved.values())

    def keep(self, params: dict[str, torch.Tensor]) -> None:
        with torch.inference_mode(False):  # ordinary tensors, usable whatever the caller's grad mode
            for name, param in params.items():
                if name not in self.saved:
                    pin = param.device.type == "cuda"
                    self.saved[name] = torch.empty(param.shape, dtype=param.dtype, pin_memory=pin).copy_(param)

    def restore(self, transformer: QwenImage21Transformer, names: Iterable[str]) -> None:
        params = dict(transformer.named_parameters())
        for name in names:
            params[name].copy_(self.saved[name], non_blocking=True)

    def forget(self, names: Iterable[str]) -> None:
        for name in names:
            self.saved.pop(name, None)


class FileOriginals:
    """Re-reads original weights from the checkpoint the transformer was loaded from (see the module docstring)."""

    nbytes = 0

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.stamp = self._stamp()

    def _stamp(self) -> tuple:
        with Checkpoint.open(self.path) as ckpt:
            files = sorted({info.file for info in ckpt.tensors.values()} | {ckpt.path})
        return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)

    def keep(self, params: dict[str, torch.Tensor]) -> None:
        pass  # the file has them

    def forget(self, names: Iterable[str]) -> None:
        pass

    def restore(self, transformer: QwenImage21Transformer, names: Iterable[str]) -> None:
        names = set(names)
        if not names:
            return
        if self._stamp() != self.stamp:
            raise LoraError(
                f"{self.path} changed on disk since the model was loaded, so the weights without the LoRA cannot be "
                "re-read from it; load the model again"
            )
        owners = {p.untyped_storage().data_ptr(): n for n, p in transformer.named_parameters()}
        slots = {
            key: slot if owners[slot.untyped_storage().data_ptr()] in names else None
            for key, slot in transformer.checkpoint_slots().items()
        }
        with Checkpoint.open(self.path) as ckpt:
            convert = key_maps.converter(identify(ckpt, "transformer"), ckpt.keys())
            load_into(slots, ckpt, convert, what="original weights (LoRA removal)")


def originals_for(transformer_path: str | os.PathLike | None) -> FileOriginals | MemoryOriginals:
    """Re-read from the transformer's checkpoint when it came from one, else keep CPU copies."""
    if transformer_path is not None and Path(transformer_path).exists():
        return FileOriginals(transformer_path)
    return MemoryOriginals()


# ---------------------------------------------------------------------------------------------------------
# Bringing the weights to a stack
# ---------------------------------------------------------------------------------------------------------


class LoraMerger:
    """Keeps track of what is merged into one transformer and brings its weights to any requested stack."""

    def __init__(self, transformer: QwenImage21Transformer, originals: FileOriginals | MemoryOriginals):
        self.transformer = transformer
        self.originals = originals
        self.merged: dict[str, tuple] = {}  # parameter -> the pieces merged into it now (absent: original bits)
        self.stack_id: tuple = ()
        self.last_stats: dict = {}

    @torch.no_grad()
    def apply(self, stack: Stack) -> None:
        """Make the weights original + `stack` (an empty stack restores the original weights)."""
        stack_id = stack_identity(stack)
        if stack_id == self.stack_id:
            return
        started = time.perf_counter()
        plan = self._plan(stack)
        wanted = {param: tuple((lora_id, s, layer.layer) for _, s, layer, lora_id in pieces)
                  for param, pieces in plan.items()}  # fmt: skip
        changed = {p for p in set(self.merged) | set(wanted) if self.merged.get(p) != wanted.get(p)}
        params = dict(self.transformer.named_parameters())
        try:
            self._restore(changed & set(self.merged))
            to_merge = sorted(changed & set(wanted))
            self.originals.keep({name: params[name] for name in to_merge})
            with full_fp32_matmul():
                for name in to_merge:
                    merge_into_weight(params[name], [(rows, s, layer) for rows, s, layer, _ in plan[name]])
                    self.merged[name] = wanted[name]
            self.originals.forget(set(params) - set(self.merged))
        except BaseException:
            self._restore(set(self.merged))  # never leave a half-merged model behind
            self._set_id(())
            raise
        self._set_id(stack_id)
        if self.transformer.device.type == "cuda":
            torch.cuda.synchronize(self.transformer.device)
        self.last_stats = {
            "seconds": round(time.perf_counter() - started, 3),
            "weights_merged": len(to_merge),
            "weights_restored": len(changed) - len(to_merge),
            "original_copies_mib": round(self.originals.nbytes / 2**20, 1),
        }
        log.info("LoRA stack %s applied: %s", [lora.path.name for lora, _ in stack], self.last_stats)

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
                plan[slot.param].append((slot.rows, float(strength), layer, lora.identity))
        return plan

    def _restore(self, names: set[str]) -> None:
        self.originals.restore(self.transformer, sorted(names))
        for name in names:
            self.merged.pop(name, None)

    def _set_id(self, stack_id: tuple) -> None:
        self.stack_id = stack_id
        self.transformer.weights_id = stack_id
