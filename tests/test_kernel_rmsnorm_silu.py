"""Channel RMSNorm (+ gamma) + SiLU kernels against their torch references, and the references against
diffusers' QwenImage21RMS_norm.

The kernels run wherever Triton can: on CUDA, and on CPU through the Triton interpreter, which needs
TRITON_INTERPRET=1 before Triton is first imported; `test_kernels_through_interpreter` reruns this file in a
child process with it set. In the parent the kernel tests skip without a GPU, saying so.

Tolerances:
* eager (exact-mode) kernel without SiLU: bit-identical to its reference (only correctly rounded divides,
  multiplies and casts). With SiLU: bit-identical on the GPU (where exp is the same expf; the GPU test and
  the runtime self-test check every value of the dtype); under the interpreter exp is numpy's, so within
  1 ulp and >= 99% identical in fp16/bf16, 4 ulp and >= 70% identical in fp32 (observed 3 ulp, 75%).
* fast kernel vs its fp32 reference: fp32 rtol/atol 1e-5 (summation order); fp16/bf16 within 1 ulp of the
  output dtype (one rounding of nearly the same fp32 value).
"""

from __future__ import annotations

import re

import pytest
import torch
import triton_interpreter
from qwen21_nodes.kernels import _triton
from qwen21_nodes.kernels import rmsnorm_silu as K

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 3, 5, 7), (2, 144, 3, 9), (1, 40, 1, 1), (2, 97, 6, 5)]  # odd channel and pixel counts
EPS = 1e-12


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at each value (fp32 tensor)."""
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[t.dtype]
    tiny = torch.finfo(t.dtype).tiny
    magnitude = t.float().abs().clamp_min(tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa)


def _inputs(shape, dtype, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, *shape[2:], generator=gen))).to(dtype)
    gamma = (1 + 0.5 * torch.randn(shape[1], 1, 1, generator=gen)).to(dtype)
    return x.contiguous(memory_format=layout), gamma


# ---------------------------------------------------------------------------------------------------------
# References (everywhere)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("images", [False, True])
def test_eager_reference_equals_diffusers_rms_norm(dtype, images):
    pytest.importorskip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage21 import QwenImage21RMS_norm

    x, _ = _inputs((2, 24, 5, 6), dtype, torch.contiguous_format)
    norm = QwenImage21RMS_norm(24, images=images).to(dtype)
    with torch.no_grad():
        norm.gamma.copy_(1 + 0.5 * torch.randn(norm.gamma.shape, generator=torch.Generator().manual_seed(1)))
        want = norm(x if images else x[:, :, None])
        want = want if images else want[:, :, 0]
        got = K.rmsnorm_silu_eager_reference(x, norm.gamma.view(-1, 1, 1), norm.scale, EPS, silu=False)
        assert torch.equal(got, want)
        got = K.rmsnorm_silu_eager_reference(x, norm.gamma.view(-1, 1, 1), norm.scale, EPS, silu=True)
        assert torch.equal(got, torch.nn.functional.silu(want))


def test_fast_reference_is_the_same_math_in_fp32():
    x, gamma = _inputs((2, 24, 5, 6), torch.float64, torch.contiguous_format)
    want = K.rmsnorm_silu_eager_reference(x, gamma, 24**0.5, EPS, silu=True)
    got = K.rmsnorm_silu_reference(x, gamma, 24**0.5, EPS, silu=True)
    assert got.dtype == torch.float64
    assert torch.allclose(got, want.to(torch.float64), rtol=1e-6, atol=1e-6)


def test_dispatchers_fall_back_where_the_kernel_cannot_run():
    x, gamma = _inputs((1, 5, 4, 4), torch.float64, torch.contiguous_format)  # float64: no kernel
    assert K.unsupported_reason(x, gamma) is not None
    assert torch.equal(
        K.rmsnorm_silu_eager(x, gamma, 2.0, EPS, True), K.rmsnorm_silu_eager_reference(x, gamma, 2.0, EPS, True)
    )


@pytest.mark.parametrize(
    "x,gamma,match",
    [
        (torch.randn(2, 3, 4), torch.ones(3), r"\[B, C, H, W\]"),
        (torch.randn(1, 3, 2, 2, dtype=torch.float64), torch.ones(3), "dtype must be one of"),
        (torch.randn(1, 3, 2, 2), torch.ones(4), "gamma must hold C=3 values"),
        (torch.randn(1, 3, 4, 6).transpose(2, 3), torch.ones(3), "do not merge H and W"),
    ],
)
def test_launchers_check_their_inputs(x, gamma, match):
    reason = K.unsupported_reason(x, gamma)
    assert reason is not None and re.search(match, reason)
    with pytest.raises(ValueError, match="rmsnorm_silu_fused: .*" + match):
        K.rmsnorm_silu_fused(x, gamma, 1.0, EPS)
    with pytest.raises(ValueError, match="rmsnorm_silu_eager_fused: .*" + match):
        K.rmsnorm_silu_eager_fused(x, gamma, 1.0, EPS, True)


# ---------------------------------------------------------------------------------------------------------
# Kernels (interpreter child process on CPU; CUDA on the GPU machine)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def kernel_device(monkeypatch):
    return triton_interpreter.kernel_device(
        monkeypatch, "no GPU here: the kernels run on CPU in the child process of test_kernels_through_interpreter"
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_fast_kernel_matches_its_reference(kernel_device, dtype, shape, layout):
    x, gamma = _inputs(shape, dtype, layout, seed=shape[1])
    x, gamma = x.to(kernel_device), gamma.to(kernel_device)
    scale = shape[1] ** 0.5
    for silu in (True, False):
        got = K.rmsnorm_silu_fused(x, gamma, scale, EPS, silu)
        want = K.rmsnorm_silu_reference(x, gamma, scale, EPS, silu)
        assert got.dtype == dtype and got.stride() == x.stride()  # same layout as the input
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert ((got.float() - want.float()).abs() <= _ulp(want)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_eager_kernel_matches_its_reference(kernel_device, dtype, shape, layout):
    x, gamma = _inputs(shape, dtype, layout, seed=shape[1] + 1)
    x, gamma = x.to(kernel_device), gamma.to(kernel_device)
    scale = shape[1] ** 0.5
    norm = K.channel_norm(x, EPS)

    got = K.rmsnorm_silu_eager_fused(x, gamma, scale, EPS, False, norm)
    assert torch.equal(got, K.rmsnorm_silu_eager_reference(x, gamma, scale, EPS, False, norm))

    got = K.rmsnorm_silu_eager_fused(x, gamma, scale, EPS, True, norm)
    want = K.rmsnorm_silu_eager_reference(x, gamma, scale, EPS, True, norm)
    assert got.stride() == x.stride()
    if kernel_device.type == "cuda":
        assert torch.equal(got, want)
    else:  # numpy's exp under the interpreter: a few ulp in fp32, rounded away in half precision
        ulps, identical = (4, 0.7) if dtype == torch.float32 else (1, 0.99)
        assert ((got.float() - want.float()).abs() <= ulps * _ulp(want)).all()
        assert (got == want).float().mean() >= identical


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_eager_kernel_matches_its_reference_written_into_a_padded_buffer(kernel_device, dtype, layout):
    x, gamma = _inputs((2, 19, 6, 11), dtype, layout, seed=3)
    x, gamma = x.to(kernel_device), gamma.to(kernel_device)
    norm = K.channel_norm(x, EPS)
    want = K.rmsnorm_silu_eager_reference(x, gamma, 19**0.5, EPS, False, norm)
    padded = torch.full((2, 19, 9, 14), 5.0, dtype=dtype, device=kernel_device).contiguous(memory_format=layout)
    interior = padded[:, :, 2:-1, 1:-2]
    assert K.rmsnorm_silu_eager_fused(x, gamma, 19**0.5, EPS, False, norm, out=interior) is interior
    assert torch.equal(interior, want)
    interior.fill_(5.0)
    assert bool((padded == 5.0).all())  # nothing outside the interior was written


def test_eager_dispatcher_writes_out_on_the_torch_path_too():
    x, gamma = _inputs((1, 7, 5, 6), torch.float32, torch.channels_last)
    out = torch.zeros(1, 7, 7, 8)[:, :, 1:-1, 1:-1]
    K.rmsnorm_silu_eager(x, gamma, 7**0.5, EPS, True, out=out)
    assert torch.equal(out, K.rmsnorm_silu_eager_reference(x, gamma, 7**0.5, EPS, True))
    with pytest.raises(ValueError, match=r"out must be torch.float32 \(1, 7, 5, 6\)"):
        K.rmsnorm_silu_eager(x, gamma, 7**0.5, EPS, True, out=torch.zeros(1, 7, 5, 5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_direct_half_precision_norm_equals_the_fp32_copy_on_the_gpu(dtype):
    K.SELF_TESTS.clear()
    assert K.direct_norm_verified(torch.device("cuda"), dtype)
    with K.SELF_TESTS.forced("direct_norm", torch.device("cuda"), dtype, False):  # "cuda" is "cuda:0"
        assert not K.direct_norm_verified(torch.device("cuda", torch.cuda.current_device()), dtype)
    assert K.direct_norm_verified(torch.device("cuda"), dtype)
    x = torch.randn(1, 288, 48, 40, device="cuda").to(dtype)  # a shape outside the self-test's list
    assert torch.equal(K.channel_norm(x, EPS), K.channel_norm_reference(x, EPS))
    # The first norm of the 1024^2 stage of a 2048^2 decode: its fp32 copy is 2.4 GB, over torch's 2^31-byte
    # line, so torch splits the copy's reduction (another order); channel_norm must then use the copy too.
    x = torch.randn(1, 576, 1024, 1024, device="cuda", dtype=dtype)
    assert torch.equal(K.channel_norm(x, EPS), K.channel_norm_reference(x, EPS))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_kernel_self_test_passes_on_the_gpu(dtype):
    if not _triton.TRITON_AVAILABLE:
        pytest.skip("Triton is not installed")
    K.SELF_TESTS.clear()
    assert K.eager_kernel_verified(torch.device("cuda"), dtype)


def test_kernels_through_interpreter():
    child = triton_interpreter.run_under_interpreter(__file__, "-k", "kernel_matches")
    assert " passed" in child.stdout and "skipped" not in child.stdout, child.stdout
