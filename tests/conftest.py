"""Shared pytest setup: GPU tests skip on machines without CUDA, saying why; stand-ins for torch.cuda's memory
queries."""

import sys
from pathlib import Path

# `python -m pytest` from the clone puts the clone first on sys.path, where our kernels/ would shadow the `kernels`
# package that transformers imports (the README's `pytest` does not): the clone is never an import root.
_CLONE = Path(__file__).resolve().parents[1]
sys.path[:] = [root for root in sys.path if Path(root).resolve() != _CLONE]

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def fake_cuda_memory(monkeypatch):
    """Stand-ins for torch.cuda's memory queries, so the free-memory arithmetic runs without a GPU. Call it with
    what the device reports: free and total (mem_get_info), reserved, allocated, the per-process fraction, the
    allocator snapshot's segments and the allocator backend. `activity`: the allocator's counts (memory_stats); by
    default new ones at every query, so every query takes a snapshot."""
    import itertools

    from qwen21_nodes.qwen21_core.memory import planner

    def install(*, free, total, reserved, allocated, fraction=1.0, segments=(), backend="native", activity=None):
        counter = itertools.count()
        monkeypatch.setattr(planner, "_pool_snapshots", {})
        answers = {
            "memory_stats": lambda device=None: (
                dict(activity) if activity is not None else {"allocation.all.allocated": next(counter)}
            ),
            "mem_get_info": lambda device=None: (free, total),
            "memory_reserved": lambda device=None: reserved,
            "memory_allocated": lambda device=None: allocated,
            "memory_snapshot": lambda: list(segments),
            "get_per_process_memory_fraction": lambda device=None: fraction,
            "get_allocator_backend": lambda: backend,
        }
        for name, answer in answers.items():
            monkeypatch.setattr(torch.cuda, name, answer)

    return install


@pytest.fixture
def use_settings(monkeypatch):
    """Run the test with some settings changed (kernels/settings.py: the pack reads its QWEN21_* variables once, so a
    changed variable alone changes nothing): use_settings(quant_gemm="emulate"). The settings before come back
    after the test."""
    import dataclasses

    from qwen21_nodes.kernels import settings

    def apply(**changes):
        monkeypatch.setattr(settings, "_current", dataclasses.replace(settings.current(), **changes))

    return apply
