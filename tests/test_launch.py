"""The direct launch (kernels/launch.py): when it is used, that its variants are at least as fine as Triton's
specialisation, that it skips Triton's per-call path, and that it launches on memory allocated inside a CUDA-graph
capture under the cudaMallocAsync allocator (ComfyUI's default)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from qwen21_nodes.kernels import launch as launch_module
from qwen21_nodes.kernels import settings
from qwen21_nodes.kernels._triton import TRITON_AVAILABLE, jit, tl

needs_gpu = pytest.mark.gpu  # skipped without a CUDA GPU (conftest.py); Triton comes with torch on CUDA machines


@pytest.fixture(autouse=True)
def decided_again():
    launch_module.set_fast_launch(None)
    yield
    launch_module.set_fast_launch(None)
    launch_module.forget_variants()


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_the_direct_launch_is_used_only_where_it_was_written_for(monkeypatch, caplog, use_settings):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch_module, "INTERPRETER_ACTIVE", False)
    monkeypatch.setattr(launch_module, "_triton_version", lambda: launch_module.TESTED_TRITON[0])
    use_settings(fast_launch=None)
    assert launch_module._decide()
    use_settings(fast_launch=False)
    assert not launch_module._decide()
    use_settings(fast_launch=None)
    monkeypatch.setattr(launch_module, "_triton_version", lambda: (2, 9))
    with caplog.at_level(logging.INFO):
        assert not launch_module._decide()
    assert "Triton's own path" in caplog.text
    use_settings(fast_launch=True)
    assert launch_module._decide()
    monkeypatch.setattr(launch_module, "INTERPRETER_ACTIVE", True)
    assert not launch_module._decide()
    monkeypatch.setattr(launch_module, "INTERPRETER_ACTIVE", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not launch_module._decide()


def test_something_that_is_not_a_jit_function_is_launched_as_it_asks():
    launched = []

    class Fake:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, args, kwargs))

    launch_module.set_fast_launch(True)
    launch_module.launch(Fake(), (3,), 1, 2, BLOCK=4)
    assert launched == [((3,), (1, 2), {"BLOCK": 4})]


def test_the_variant_key_separates_what_triton_specialises_on():
    """CPU tensors have addresses too: the key logic without a GPU. Same class, same key; another class, another."""
    import numpy as np

    base = torch.zeros(64)
    constexpr = [False, False, False, True]

    def key(*args, **kwargs):
        return launch_module.variant_key(constexpr, 0, args, kwargs)[0]

    same = [key(base[:8], 32, 0.5, 4), key(base[16:], 48, 0.25, 4)]  # aligned, a multiple of 16, a float
    assert same[0] == same[1]
    others = [
        key(base[1:], 32, 0.5, 4),  # a misaligned pointer
        key(base.half()[:8], 32, 0.5, 4),  # another dtype
        key(base, 1, 0.5, 4),  # an integer equal to 1
        key(base, 33, 0.5, 4),  # neither 1 nor a multiple of 16
        key(base, 2**40, 0.5, 4),  # 64-bit
        key(base, 32, None, 4),  # None instead of a float
        key(base, 32, 0.5, 8),  # another constexpr value
        key(base, 32, 0.5, 4, num_warps=8),  # another option
        key(base, np.int64(32), 0.5, 4),  # a numpy integer: by value
    ]
    assert len({same[0], *others}) == len(others) + 1
    assert key(base, np.int64(32), 0.5, 4) != key(base, np.int64(48), 0.5, 4)
    _, values = launch_module.variant_key(constexpr, 0, (base[1:], 32, 0.5, 4), {})
    assert values == [base[1:].data_ptr(), 32, 0.5, 4]  # pointers as integers, the rest as given


class _SlowKernel:
    """A stand-in for a JIT function on the CPU: its `warmup` (Triton's compile) counts its calls. With a barrier of
    two, a compile ends only once a second one runs beside it: compiles of two variants that could not overlap fail
    with BrokenBarrierError (a RuntimeError) instead of passing by timing."""

    def __init__(self, fail: bool = False, barrier: threading.Barrier | None = None):
        self.params = [SimpleNamespace(name=n, is_constexpr=n == "BLOCK", has_default=False, default=None)
                       for n in ("x_ptr", "n", "BLOCK")]  # fmt: skip
        self.compiles: list[tuple] = []
        self.fail = fail
        self.barrier = barrier
        self.lock = threading.Lock()

    def warmup(self, *args, grid, **kwargs):
        with self.lock:
            self.compiles.append(tuple(kwargs.items()))
        if self.barrier is not None:
            self.barrier.wait(timeout=10)
        time.sleep(0.1)  # long enough for the other threads to meet this variant while it compiles
        if self.fail:
            raise RuntimeError("out of resource: shared memory")
        return SimpleNamespace(run=None, function=0, packed_metadata=None)


def _compile_from_threads(fn, keys_kwargs: list[dict]) -> list:
    kernel = launch_module._Kernel(fn)
    x = torch.zeros(16)
    results, errors = [], []

    def one(kwargs):
        key, _ = launch_module.variant_key(kernel.constexpr, 0, (x, 16), kwargs)
        try:
            results.append(launch_module._compile(fn, kernel, key, (1,), (x, 16), kwargs))
        except RuntimeError as error:
            errors.append(error)

    threads = [threading.Thread(target=one, args=(kwargs,)) for kwargs in keys_kwargs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, errors


def test_threads_meeting_one_new_variant_compile_it_once_and_other_variants_do_not_wait():
    fn = _SlowKernel(barrier=threading.Barrier(2))  # the two variants' compiles must overlap to finish
    results, errors = _compile_from_threads(fn, [{"BLOCK": 64}] * 6 + [{"BLOCK": 128}] * 2)
    assert not errors and len(results) == 8
    assert sorted(fn.compiles) == [(("BLOCK", 64),), (("BLOCK", 128),)]  # once each, not 6 and 2 times
    assert len({id(r) for r in results}) == 2  # every thread got its variant
    assert launch_module._in_flight == {}


def test_when_the_compiling_thread_fails_the_waiting_ones_meet_the_error_too():
    fn = _SlowKernel(fail=True)
    results, errors = _compile_from_threads(fn, [{"BLOCK": 64}] * 3)
    assert results == [] and len(errors) == 3 and "out of resource" in str(errors[0])
    assert launch_module._in_flight == {}  # nothing left waiting: a later launch tries again


@jit
def _scaled_copy(x_ptr, out_ptr, n, stride, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    values = tl.load(x_ptr + offsets * stride, mask=mask)
    tl.store(out_ptr + offsets, values * factor, mask=mask)


def _copy(x, factor=2.0, block=128):
    out = torch.empty(x.numel(), device=x.device, dtype=x.dtype)
    n = x.numel()
    launch_module.launch(_scaled_copy, ((n + block - 1) // block,), x, out, n, x.stride(0), factor, BLOCK=block)
    return out


@needs_gpu
def test_variants_follow_what_triton_specialises_on_and_agree_with_its_path():
    launch_module.set_fast_launch(True)
    base = torch.randn(4096, device="cuda")
    cases = [base[:1024], base[1:1025], base[:1], base[:16], base[:17], base[::2][:100], base.half()[:64]]
    for x in cases:
        want = x.float() * 2.0
        torch.testing.assert_close(_copy(x).float(), want, rtol=0, atol=0)
    # aligned and misaligned pointers, a size of 1, of 16, of neither, a stride of 2, another dtype: distinct keys
    assert len(launch_module._kernels[id(_scaled_copy)].variants) >= 6
    # the same classes again reuse them, and agree with Triton's own path
    count = len(launch_module._kernels[id(_scaled_copy)].variants)
    for x in (base[2048:3072], base[3:1027], base[:33]):
        direct = _copy(x, factor=0.5)
        launch_module.set_fast_launch(False)
        torch.testing.assert_close(_copy(x, factor=0.5), direct, rtol=0, atol=0)
        launch_module.set_fast_launch(True)
    assert len(launch_module._kernels[id(_scaled_copy)].variants) == count


@needs_gpu
def test_a_known_variant_skips_tritons_per_call_path(monkeypatch):
    launch_module.set_fast_launch(True)
    x = torch.randn(1000, device="cuda")
    _copy(x)  # the first call compiles (or finds) the variant through Triton's warmup
    calls = []
    real_run = type(_scaled_copy).run

    def counting_run(self, *args, **kwargs):
        calls.append(kwargs.get("warmup"))
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(type(_scaled_copy), "run", counting_run)
    out = _copy(x, factor=3.0)
    torch.testing.assert_close(out, x * 3.0, rtol=0, atol=0)
    assert calls == []
    launch_module.set_fast_launch(False)
    _copy(x)
    assert calls == [False]  # Triton's path binds every call


CAPTURE_CHILD = textwrap.dedent(
    """
    import sys

    import torch

    sys.path.insert(0, sys.argv[1])
    from test_launch import _copy

    assert torch.cuda.get_allocator_backend() == "cudaMallocAsync", torch.cuda.get_allocator_backend()
    x = torch.randn(3000, device="cuda")
    _copy(x)  # compiled outside the capture, as a decode step is before its capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            inside = x * 1.0  # allocated inside the capture
            out = _copy(inside, factor=4.0)
    x.copy_(torch.randn(3000, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 4.0)
    print("replayed right")
    """
)


@needs_gpu
@pytest.mark.parametrize("direct", [True, False])
def test_a_direct_launch_runs_inside_a_capture_under_cudamallocasync(direct):
    """Triton's own path asks the driver whether a pointer is device memory, and memory allocated inside a capture
    under cudaMallocAsync is not yet: the reason decode graphs were off inside ComfyUI. Run in a child process: a
    failed capture there can abort the process."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync",
           settings.FAST_LAUNCH: "1" if direct else "0"}  # fmt: skip
    done = subprocess.run([sys.executable, "-P", "-c", CAPTURE_CHILD, here], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    output = done.stdout + done.stderr
    if direct:
        assert done.returncode == 0 and "replayed right" in output, output[-3000:]
    else:
        assert done.returncode != 0 and "replayed right" not in output, output[-3000:]


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="Triton is not installed")
def test_the_host_grid_helpers_compute_what_tritons_do():
    """kernels/_triton.py's cdiv and next_power_of_2 replace Triton's (slower) host calls in every launch grid."""
    import triton
    from qwen21_nodes.kernels._triton import cdiv, next_power_of_2

    for n in [0, 1, 2, 3, 15, 16, 17, 127, 128, 129, 4095, 4096, 4097, 12288, 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (1, 4, 16, 64, 128, 1000):
            assert cdiv(n, block) == triton.cdiv(n, block), (n, block)
