"""The self-test bookkeeping the kernel modules share (kernels/_triton.py): each check runs once per
(device, dtype), a crashing check counts as failed, and a forced result is undone afterwards."""

from __future__ import annotations

import torch
from qwen21_nodes.kernels._triton import SelfTests, pixel_strides, same_bits


def test_a_check_runs_once_per_device_and_dtype_and_a_crash_counts_as_failed():
    tests = SelfTests("demo")
    runs = []
    cpu = torch.device("cpu")
    assert tests.passed("ok", cpu, torch.float32, lambda: runs.append(1) or True)
    assert tests.passed("ok", cpu, torch.float32, lambda: runs.append(1) or False)  # cached
    assert not tests.passed("ok", cpu, torch.bfloat16, lambda: runs.append(1) or False)  # another dtype
    assert len(runs) == 2

    def crash():
        raise RuntimeError("no kernel image")

    assert not tests.passed("crash", cpu, torch.float32, crash)


def test_a_forced_result_lasts_for_the_block_only():
    tests = SelfTests("demo")
    cpu = torch.device("cpu")
    assert tests.passed("check", cpu, torch.float32, lambda: True)
    with tests.forced("check", cpu, torch.float32, False):
        assert not tests.passed("check", cpu, torch.float32, lambda: True)
    assert tests.passed("check", cpu, torch.float32, lambda: False)  # the real result again
    with tests.forced("fresh", cpu, torch.float32, True):
        assert tests.passed("fresh", cpu, torch.float32, lambda: False)
    assert not tests.passed("fresh", cpu, torch.float32, lambda: False)  # never cached: runs now


def test_pixel_strides_and_same_bits():
    x = torch.zeros(2, 3, 4, 5)
    assert pixel_strides(x) == (60, 20, 1)
    assert pixel_strides(x.contiguous(memory_format=torch.channels_last)) == (60, 1, 3)
    assert pixel_strides(x.transpose(2, 3)) is None
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bits(nan, nan.clone()) and not same_bits(nan, torch.tensor([float("nan"), 2.0]))
