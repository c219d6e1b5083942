"""The conv-bias + residual kernel against its torch formulation: bit-identical in every dtype (fp32 adds,
one rounding to the dtype per sum, as torch rounds), including overflow, NaN, signed zeros and the fp16
guard; plus the GPU self-test that torch's conv adds its bias as a separate rounding there.

The kernel runs on CUDA, and on CPU through the Triton interpreter in the child process of
`test_kernels_through_interpreter` (see triton_interpreter.py); in the parent those tests skip without a GPU.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton_interpreter
from qwen21_nodes.kernels import _triton
from qwen21_nodes.kernels import bias_residual as K

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 3, 5, 7), (2, 144, 3, 9), (1, 70, 1, 1), (2, 9, 16, 16)]


@pytest.fixture
def kernel_device(monkeypatch):
    return triton_interpreter.kernel_device(
        monkeypatch, "no GPU here: the kernel runs on CPU in the child process of test_kernels_through_interpreter"
    )


def _tensors(shape, dtype, seed, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    y = (torch.randn(shape, generator=gen) * scale).to(dtype)
    bias = (torch.randn(shape[1], generator=gen) * scale).to(dtype)
    residual = (torch.randn(shape, generator=gen) * scale).to(dtype)
    return y, bias, residual


def _same(a, b):
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "y_layout,r_layout",
    [
        (torch.contiguous_format, torch.contiguous_format),
        (torch.channels_last, torch.channels_last),
        (torch.channels_last, torch.contiguous_format),
    ],
)
def test_kernel_matches_its_reference(kernel_device, dtype, shape, y_layout, r_layout):
    y, bias, residual = _tensors(shape, dtype, seed=shape[1])
    y = y.to(kernel_device).contiguous(memory_format=y_layout)
    bias, residual = bias.to(kernel_device), residual.to(kernel_device).contiguous(memory_format=r_layout)
    for with_residual in (False, True):
        r = residual if with_residual else None
        want = K.add_bias_residual_reference(y.clone(), bias, r)
        got = y.clone()
        assert K.add_bias_residual_(got, bias, r) is got  # in place
        assert got.stride() == y.stride() and _same(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_its_reference_at_the_dtype_limits(kernel_device, dtype):
    limit, tiny = torch.finfo(dtype).max, torch.finfo(dtype).tiny
    values = torch.tensor([limit, -limit, float("nan"), float("inf"), 1.0, -0.0, tiny, -tiny / 2])
    y = values.repeat(4, 1).reshape(1, 4, 8, 1).to(kernel_device, dtype)
    residual = values.flip(0).repeat(4, 1).reshape(1, 4, 8, 1).to(kernel_device, dtype)
    bias = torch.tensor([limit, -limit, 0.0, -0.0]).to(kernel_device, dtype)
    for clamp in (False, True):
        want = K.add_bias_residual_reference(y.clone(), bias, residual, clamp_fp16=clamp)
        assert _same(K.add_bias_residual_(y.clone(), bias, residual, clamp_fp16=clamp), want)
        if clamp and dtype == torch.float16:
            assert not torch.isinf(want).any() and torch.isnan(want).any()  # the guard clamps, NaN stays


@pytest.mark.parametrize(
    "y,bias,residual,match",
    [
        (torch.zeros(2, 3, 4), torch.zeros(3), None, r"\[B, C, H, W\]"),
        (torch.zeros(1, 3, 2, 2), torch.zeros(4), None, "bias must hold C=3"),
        (torch.zeros(1, 3, 2, 2), torch.zeros(3, dtype=torch.float16), None, "bias must hold C=3 values of"),
        (torch.zeros(1, 3, 2, 2), torch.zeros(3), torch.zeros(1, 3, 2, 3), "residual must match y"),
        (torch.zeros(1, 3, 4, 6).transpose(2, 3), torch.zeros(3), None, "H and W mergeable"),
    ],
)
def test_the_launcher_checks_its_inputs(y, bias, residual, match):
    reason = K.unsupported_reason(y, bias, residual)
    assert reason is not None and re.search(match, reason)
    with pytest.raises(ValueError, match="add_bias_residual_: .*" + match):
        K.add_bias_residual_(y, bias, residual)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_self_test_passes_on_the_gpu(dtype):
    if not _triton.TRITON_AVAILABLE:
        pytest.skip("Triton is not installed")
    K.SELF_TESTS.clear()
    assert K.epilogue_verified(torch.device("cuda"), dtype)


def test_kernels_through_interpreter():
    child = triton_interpreter.run_under_interpreter(__file__, "-k", "kernel_matches")
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout
