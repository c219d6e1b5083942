"""Priming torch's own CUDA kernels from the pack's import (qwen21_core/cuda_priming.py): it starts only where CUDA is
already initialised and the warm-up is on, once per device; a failing step is logged and the others run; the steps
run tiny models of the real classes and leave the process's random state and default dtype alone."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from qwen21_nodes.qwen21_core import cuda_priming, settings


@pytest.fixture
def cuda_as_initialised(monkeypatch, use_settings):
    """CUDA as ComfyUI leaves it before it loads custom nodes (available, initialised, device 0), no thread started
    yet; `_prime` records the devices it was started for instead of launching kernels."""
    primed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda_priming, "_started", {})
    monkeypatch.setattr(cuda_priming, "_prime", lambda device, steps: primed.append(device))
    use_settings(kernel_warmup=True)
    return primed


def test_nothing_is_primed_where_cuda_is_not_initialised(monkeypatch):
    monkeypatch.setattr(cuda_priming, "_started", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # e.g. ComfyUI started with --cpu
    assert cuda_priming.prime_cuda_kernels() is None
    assert cuda_priming._started == {}


def test_priming_starts_once_per_device(cuda_as_initialised):
    first = cuda_priming.prime_cuda_kernels()
    assert isinstance(first, threading.Thread)
    first.join(5)
    assert cuda_as_initialised == [torch.device("cuda", 0)]
    assert cuda_priming.prime_cuda_kernels() is first
    assert cuda_priming.prime_cuda_kernels(torch.device("cuda", 0)) is first
    other = cuda_priming.prime_cuda_kernels(torch.device("cuda", 1))
    other.join(5)
    assert other is not first
    assert cuda_as_initialised == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_the_warmup_switch_turns_priming_off(cuda_as_initialised, use_settings):
    use_settings(kernel_warmup=False)
    assert cuda_priming.prime_cuda_kernels() is None
    assert cuda_as_initialised == []


def test_a_failing_step_is_logged_and_the_others_run(caplog):
    ran = []

    def broken(device, dtype):
        raise RuntimeError("no such kernel")

    steps = [("first", lambda d, t: ran.append("first")), ("broken", broken), ("last", lambda d, t: ran.append("last"))]
    with caplog.at_level(logging.WARNING, logger=cuda_priming.__name__):
        failed = cuda_priming.run_steps(torch.device("cpu"), steps)
    assert ran == ["first", "last"]
    assert failed == ["broken (RuntimeError: no such kernel)"]
    assert "broken (RuntimeError: no such kernel)" in caplog.text


def test_the_steps_run_tiny_models_and_leave_the_random_state_and_default_dtype_alone():
    """On the CPU the same code runs torch's CPU kernels; the flash step needs CUDA (the GPU test runs it)."""
    steps = [(name, step) for name, step in cuda_priming.priming_steps() if name != "flash attention"]
    assert [name for name, _ in steps] == ["text prompt", "DiT entry"]
    state = torch.get_rng_state()
    assert cuda_priming.run_steps(torch.device("cpu"), steps) == []
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.get_default_dtype() == torch.float32


def _run_python(lines: list[str]) -> str:
    """The last line a fresh interpreter prints running `lines` (the warm-up switch unset)."""
    env = {name: value for name, value in os.environ.items() if name != settings.KERNEL_WARMUP}
    done = subprocess.run([sys.executable, "-P", "-c", "\n".join(lines)], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_steps_import_nothing_in_the_priming_thread():
    """Every import happens when the steps are made (the caller's thread): an import in the priming thread racing one
    of ComfyUI's main thread could deadlock Python's import locks. A fresh interpreter, so nothing was imported by an
    earlier test."""
    imported = _run_python([
        "import sys, torch",
        "import qwen21_nodes.nodes",
        "from qwen21_nodes.qwen21_core import cuda_priming",
        "steps = [s for s in cuda_priming.priming_steps() if s[0] != 'flash attention']",
        "before = set(sys.modules)",
        "assert cuda_priming.run_steps(torch.device('cpu'), steps) == []",
        "print(sorted(set(sys.modules) - before))",
    ])  # fmt: skip
    assert imported == "[]"


def test_importing_the_nodes_starts_priming_where_cuda_is_initialised():
    """A fresh interpreter, CUDA faked as ComfyUI leaves it: importing the node classes starts the priming thread."""
    primed = _run_python([
        "import torch",
        "torch.cuda.is_available = lambda: True",
        "torch.cuda.is_initialized = lambda: True",
        "torch.cuda.current_device = lambda: 0",
        "from qwen21_nodes.qwen21_core import cuda_priming",
        "primed = []",
        "cuda_priming._prime = lambda device, steps: primed.append(device)",
        "import qwen21_nodes.nodes",
        "cuda_priming._started[0].join(5)",
        "print(primed)",
    ])  # fmt: skip
    assert primed == "[device(type='cuda', index=0)]"


@pytest.mark.gpu
def test_on_the_gpu_every_step_primes_without_failing():
    device = torch.device("cuda", torch.cuda.current_device())
    state = torch.cuda.get_rng_state(device)
    assert cuda_priming.run_steps(device, cuda_priming.priming_steps()) == []
    torch.cuda.synchronize(device)
    assert torch.equal(torch.cuda.get_rng_state(device), state)
