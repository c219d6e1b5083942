"""Compile the weight-only dequantisation kernel (kernels/dequantize_weight.py) before an encode needs it.

The text encoder's QuantLinears always take the weight-only path, and the DiT's do where no W8A8 GEMM runs; both
dequantise through the same kernel, one compile per (device, storage dtype, output dtype). One job per such key met
in the given models: queued in the background warm-up (qwen21_core/startup/warmup.py, part "text"), each key is marked
pending at once, so the layers use torch's expression (the same bits) until the job has compiled and checked the
kernel, and the kernel from then on. The jobs need no weights, only the dtypes: the models may be anywhere meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ...kernels import dequantize_weight
from ...kernels.dequantize_gguf import BLOCKS, dequantize_gguf, row_bytes
from ...kernels.dequantize_gguf import QUANTIZED as GGUF_QUANTIZED
from ..memory.planner import indexed_device
from .gguf_linear import GGUFLinear
from .linear import QuantLinear


def dequantize_keys(models: Iterable[tuple[nn.Module | None, torch.device]]) -> list[tuple]:
    """The (device, storage dtype, compute dtype) of every QuantLinear in the models, each model at the CUDA device
    it runs on, in order of first appearance."""
    keys: dict[tuple, None] = {}
    for model, device in models:
        device = indexed_device(device)
        if model is None or device.type != "cuda":
            continue
        for module in model.modules():
            if isinstance(module, QuantLinear) and not isinstance(module, GGUFLinear):  # GGUF: its own kernel
                keys[(device, module.qweight.dtype, module.compute_dtype)] = None
    return list(keys)


def dequantize_warmup_jobs(models: Iterable[tuple[nn.Module | None, torch.device]]) -> list[Callable[[], None]]:
    """One job per key of `dequantize_keys`, each marked pending now (call this only for a warm-up that starts)."""
    jobs = []
    for key in dequantize_keys(models):
        dequantize_weight.expect_warm_up(*key)
        jobs.append(lambda key=key: dequantize_weight.warm_up(*key))
    return jobs


def gguf_warmup_jobs(model: nn.Module | None, device: torch.device) -> list[Callable[[], None]]:
    """One job per (GGUF block type, compute dtype) of the model's GGUF layers: compile the block dequantisation
    (kernels/dequantize_gguf.py) on a few blocks, so that no step compiles it (a decode-graph capture could not)."""
    device = indexed_device(device)
    if model is None or device.type != "cuda":
        return []
    keys = {(qtype, module.compute_dtype) for module in model.modules() if isinstance(module, GGUFLinear)
            for qtype in module.fmt.types if qtype in GGUF_QUANTIZED}  # fmt: skip
    return [lambda qtype=qtype, dtype=dtype: _compile_gguf(qtype, dtype, device) for qtype, dtype in sorted(
        keys, key=str)]  # fmt: skip


def _compile_gguf(qtype: str, dtype: torch.dtype, device: torch.device) -> None:
    size = BLOCKS[qtype][0]
    blocks = torch.zeros(2, row_bytes(qtype, 4 * size), dtype=torch.uint8, device=device)  # zero scales: finite
    dequantize_gguf(blocks, qtype, 4 * size, dtype)
