"""The two decode-attention helper kernels against their torch formulations: the log-sum-exp merge of a prefix
and a target attention (about an ulp: the GPU's exp), and the per-token-and-head K/V dequantisation
(bit-identical). On CUDA, and on CPU through the Triton interpreter in the child process of
`test_kernels_through_interpreter`."""

from __future__ import annotations

import pytest
import torch
import triton_interpreter
from qwen21_nodes.kernels import attention_merge as M
from qwen21_nodes.kernels import kv_quant as K


@pytest.fixture
def kernel_device(monkeypatch):
    return triton_interpreter.kernel_device(
        monkeypatch, "no GPU here: the kernels run on CPU in the child process of test_kernels_through_interpreter"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,n,h,d", [(1, 5, 3, 16), (2, 7, 32, 128)])
def test_merge_matches_its_reference(kernel_device, dtype, b, n, h, d):
    gen = torch.Generator().manual_seed(n * h)
    # SDPA's layouts: outputs [B, H, N, D] seen as [B, N, H, D], lse [B, H, N] seen as [B, N, H]
    out_p = torch.randn(b, h, n, d, generator=gen).to(kernel_device, dtype).transpose(1, 2)
    out_t = torch.randn(b, h, n, d, generator=gen).to(kernel_device, dtype).transpose(1, 2)
    lse_p = (torch.randn(b, h, n, generator=gen) * 4).to(kernel_device).permute(0, 2, 1)
    lse_t = (torch.randn(b, h, n, generator=gen) * 4).to(kernel_device).permute(0, 2, 1)
    got = M.merge(out_p, lse_p, out_t, lse_t)
    want = M.merge_reference(out_p, lse_p, out_t, lse_t)
    assert got.shape == (b, n, h, d) and got.dtype == dtype
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(got.float(), want.float(), atol=tolerance, rtol=tolerance)


def test_merge_is_the_softmax_over_both_key_sets():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen) for _ in range(3))
    scores = q @ k.transpose(-1, -2) / 8**0.5  # keys 0..2: the prefix, 3..5: the target
    full = torch.softmax(scores, -1) @ v
    prefix, target = scores[..., :3], scores[..., 3:]
    op, lp = torch.softmax(prefix, -1) @ v[..., :3, :], torch.logsumexp(prefix, -1)
    ot, lt = torch.softmax(target, -1) @ v[..., 3:, :], torch.logsumexp(target, -1)
    merged = M.merge_reference(op.transpose(1, 2), lp.permute(0, 2, 1), ot.transpose(1, 2), lt.permute(0, 2, 1))
    assert torch.allclose(merged, full.transpose(1, 2), atol=1e-6)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kv_dequantisation_is_bit_identical(kernel_device, fmt, dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 37, 5, 64, generator=gen) * 3).to(kernel_device)
    q, scale = K.quantize_kv(x, fmt)
    got = K.dequantize_kv(q, scale, torch.empty(x.shape, dtype=dtype, device=kernel_device))
    want = K.dequantize_kv_reference(q, scale, torch.empty(x.shape, dtype=dtype, device=kernel_device))
    assert torch.equal(got, want)


def test_kernels_through_interpreter():
    child = triton_interpreter.run_under_interpreter(__file__, "-k", "not interpreter and not softmax")
    assert " passed" in child.stdout and " failed" not in child.stdout, child.stdout
