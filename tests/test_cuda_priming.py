"""Priming (qwen21_core/startup/priming.py): PyTorch's own CUDA kernels and Triton's cache key load in background
threads when a model starts loading, never at the pack's import; once per process (and device), only on CUDA and with
the warm-up on; a failing step is logged and the others run; the steps run tiny models of the real classes and leave
the process's random state and default dtype alone."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch
from qwen21_nodes.qwen21_core import settings
from qwen21_nodes.qwen21_core.startup import priming


@pytest.fixture
def cuda_as_initialised(monkeypatch, use_settings):
    """CUDA as ComfyUI leaves it before it loads custom nodes (available, initialised, device 0), no thread started
    yet; `_prime` records the devices it was started for instead of launching kernels, Triton's key is not hashed."""
    primed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(priming, "_started", {})
    monkeypatch.setattr(priming, "_prime", lambda device, steps: primed.append(device))
    monkeypatch.setattr(priming, "prime_triton_cache_key", lambda: None)
    use_settings(kernel_warmup=True)
    return primed


def test_nothing_is_primed_off_cuda(monkeypatch):
    monkeypatch.setattr(priming, "_started", {})
    monkeypatch.setattr(priming, "prime_triton_cache_key", lambda: pytest.fail("no CUDA load, no Triton key"))
    priming.prime(torch.device("cpu"))  # e.g. ComfyUI started with --cpu: a model loads to the CPU
    assert priming.prime_torch_kernels(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    priming.prime(torch.device("cuda", 0))
    assert priming.prime_torch_kernels() is None
    assert priming._started == {}


def test_a_load_primes_its_device_before_it_reads_the_files(cuda_as_initialised, monkeypatch):
    """from_pretrained starts the priming first, so it runs while the files are read (the load itself is stopped
    here, after the priming started: no files, no GPU)."""
    from qwen21_nodes.qwen21_core.checkpoints import loading
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline

    def reading(*args, **kwargs):
        assert priming._started, "the load read its files before priming started"
        raise RuntimeError("stop after the priming started")

    monkeypatch.setattr(loading, "load_components", reading)
    with pytest.raises(RuntimeError, match="stop after"):
        Qwen21Pipeline.from_pretrained("no-such-folder", device="cuda:1")
    priming._started[1].join(5)
    assert cuda_as_initialised == [torch.device("cuda", 1)]


def test_priming_starts_once_per_device(cuda_as_initialised):
    first = priming.prime_torch_kernels()
    assert isinstance(first, threading.Thread)
    first.join(5)
    assert cuda_as_initialised == [torch.device("cuda", 0)]
    assert priming.prime_torch_kernels() is first
    assert priming.prime_torch_kernels(torch.device("cuda", 0)) is first
    other = priming.prime_torch_kernels(torch.device("cuda", 1))
    other.join(5)
    assert other is not first
    assert cuda_as_initialised == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_the_warmup_switch_turns_priming_off(cuda_as_initialised, use_settings):
    use_settings(kernel_warmup=False)
    assert priming.prime_torch_kernels() is None
    assert cuda_as_initialised == []


def test_a_failing_step_is_logged_and_the_others_run(caplog):
    ran = []

    def broken(device, dtype):
        raise RuntimeError("no such kernel")

    steps = [("first", lambda d, t: ran.append("first")), ("broken", broken), ("last", lambda d, t: ran.append("last"))]
    with caplog.at_level(logging.WARNING, logger=priming.__name__):
        failed = priming.run_steps(torch.device("cpu"), steps)
    assert ran == ["first", "last"]
    assert failed == ["broken (RuntimeError: no such kernel)"]
    assert "broken (RuntimeError: no such kernel)" in caplog.text


def test_the_steps_run_tiny_models_and_leave_the_random_state_and_default_dtype_alone():
    """On the CPU the same code runs torch's CPU kernels; the flash step needs CUDA (the GPU test runs it)."""
    steps = [(name, step) for name, step in priming.priming_steps() if name != "flash attention"]
    assert [name for name, _ in steps] == ["text prompt", "DiT entry"]
    state = torch.get_rng_state()
    assert priming.run_steps(torch.device("cpu"), steps) == []
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
        "from qwen21_nodes.qwen21_core.startup import priming",
        "steps = [s for s in priming.priming_steps() if s[0] != 'flash attention']",
        "before = set(sys.modules)",
        "assert priming.run_steps(torch.device('cpu'), steps) == []",
        "print(sorted(set(sys.modules) - before))",
    ])  # fmt: skip
    assert imported == "[]"


def test_importing_the_pack_starts_no_thread():
    """A fresh interpreter (-P), CUDA faked as ComfyUI leaves it before it loads custom nodes: importing the pack and
    reading its node classes, as ComfyUI does, starts no thread (start-up work begins when a model loads)."""
    started = _run_python([
        "import threading, torch",
        "torch.cuda.is_available = lambda: True",
        "torch.cuda.is_initialized = lambda: True",
        "torch.cuda.current_device = lambda: 0",
        "before = set(threading.enumerate())",
        "import qwen21_nodes",
        "import qwen21_nodes.nodes",
        "assert qwen21_nodes.NODE_CLASS_MAPPINGS",
        "print(sorted(t.name for t in set(threading.enumerate()) - before))",
    ])  # fmt: skip
    assert started == "[]"


def test_tritons_cache_key_is_hashed_once_in_a_background_thread(monkeypatch):
    """A restart's first compile hashed Triton's installation on the first image's critical path (0.35 s on the
    H200): a load starts that hash in a thread of its own, once per process."""
    calls = []
    done = threading.Event()

    def key():
        calls.append(threading.current_thread().name)
        done.set()

    monkeypatch.setattr(priming, "_triton_key", None)
    monkeypatch.setattr(priming, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(priming, "INTERPRETER_ACTIVE", False)
    monkeypatch.setattr(priming, "triton_key_function", lambda: key)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert priming.prime_triton_cache_key() is None and not calls  # no CUDA: nothing to compile, nothing to hash
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    first = priming.prime_triton_cache_key()
    assert priming.prime_triton_cache_key() is first
    assert done.wait(5)
    first.join(5)
    assert calls == ["qwen21-triton-key"]


def test_the_cache_key_function_is_found_where_this_triton_keeps_it():
    from qwen21_nodes.kernels import _triton

    if not _triton.TRITON_AVAILABLE:
        pytest.skip("Triton is not installed here")
    assert callable(_triton.triton_key_function())


@pytest.mark.gpu
def test_on_the_gpu_every_step_primes_without_failing():
    device = torch.device("cuda", torch.cuda.current_device())
    state = torch.cuda.get_rng_state(device)
    assert priming.run_steps(device, priming.priming_steps()) == []
    torch.cuda.synchronize(device)
    assert torch.equal(torch.cuda.get_rng_state(device), state)
