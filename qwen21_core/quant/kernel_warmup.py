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
from ..memory.planner import indexed_device
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
            if isinstance(module, QuantLinear):
                keys[(device, module.qweight.dtype, module.compute_dtype)] = None
    return list(keys)


def dequantize_warmup_jobs(models: Iterable[tuple[nn.Module | None, torch.device]]) -> list[Callable[[], None]]:
    """One job per key of `dequantize_keys`, each marked pending now (call this only for a warm-up that starts)."""
    jobs = []
    for key in dequantize_keys(models):
        dequantize_weight.expect_warm_up(*key)
        jobs.append(lambda key=key: dequantize_weight.warm_up(*key))
    return jobs
