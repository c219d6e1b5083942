"""The quantisation kernels against their torch formulations: per-row activation quantisation with its fused
pre-ops (modulated LayerNorm, SwiGLU, int8 dequant) and ConvRot rotation, the GEMM epilogue (dequant + gated
residual, bit-identical) and the int8 GEMM with that epilogue fused (bit-identical to the exact product).

The kernels run on CUDA, and on CPU through the Triton interpreter in the child process of
`test_kernels_through_interpreter` (see triton_interpreter.py); in the parent those tests skip without a GPU.
"""

from __future__ import annotations

import pytest
import torch
import triton_interpreter
from qwen21_nodes.kernels import _triton
from qwen21_nodes.kernels import int8_gemm as G
from qwen21_nodes.kernels import linear_epilogue as E
from qwen21_nodes.kernels import quantize_rows as Q


@pytest.fixture
def kernel_device(monkeypatch):
    return triton_interpreter.kernel_device(
        monkeypatch, "no GPU here: the kernels run on CPU in the child process of test_kernels_through_interpreter"
    )


def _inputs(mode, m, k, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    kw = {}
    if mode == "layer_norm":
        x = torch.randn(m, k, generator=gen) * 3 + 0.5
        mod = 1 + 0.3 * torch.randn(3, k, generator=gen)
        kw["layer_norm"] = Q.LayerNormModulation(mod.to(device, dtype), -(-m // 3), 1e-6)
    elif mode in ("swiglu", "swiglu_dequant"):
        x = torch.randn(m, 2 * k, generator=gen) * 2
        kw["swiglu"] = True
    else:
        x = torch.randn(m, k, generator=gen) * 4
    if mode == "swiglu_dequant":
        x = torch.randint(-30000, 30000, x.shape, generator=gen, dtype=torch.int32)
        kw["dequant"] = (
            (torch.rand(m, generator=gen) * 1e-3).to(device),
            (torch.rand(2 * k, generator=gen) * 1e-3).to(device),
        )
        return x.to(device), kw
    return x.to(device, dtype), kw


def _step_diff(got, want, fmt):
    """|got - want| in quantisation steps: int8 steps are 1; fp8 steps are the e4m3 spacing at the value."""
    diff = (got.float() - want.float()).abs()
    if fmt == "int8":
        return diff
    spacing = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp(min=2.0**-6))) - 3)
    return diff / spacing


# (rows, row width): whole rows in one pass, including a padded one (768 -> 1024); the chunked path (> 16384)
SHAPES = [(1, 256), (37, 512), (130, 768), (3, Q.WHOLE_ROW_LIMIT + 256)]


@pytest.mark.parametrize("fmt,rotation", [("int8", 0), ("fp8", 0), ("int8", 256)])
@pytest.mark.parametrize("mode", ["plain", "layer_norm", "swiglu", "swiglu_dequant"])
@pytest.mark.parametrize("m,k", SHAPES)
def test_quantize_rows_matches_reference(kernel_device, fmt, rotation, mode, m, k):
    dtype = torch.bfloat16
    x, kw = _inputs(mode, m, k, dtype, kernel_device, seed=m + k)
    q, scale = Q.quantize_rows(x, fmt, rotation, **kw)
    want_q, want_scale = Q.quantize_rows_reference(x, fmt, rotation, **kw)
    assert q.dtype == Q.STORAGE[fmt] and q.shape == (m, k) and scale.shape == (m,) and scale.dtype == torch.float32
    steps = _step_diff(q, want_q, fmt)
    if mode == "plain" and not rotation:  # no reduction order, no transcendental, IEEE division: exact
        assert torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())
        return
    # Sums in another order (LayerNorm statistics, rotation) and the GPU's exp can move an fp32 value by an ulp;
    # rounded to bf16 before quantising, that can cross one bf16 step (2^-8 relative) and then a quantisation step.
    # The rotation's second dot rounds to tf32 on the GPU (2^-11 of a value of up to 127 steps, ~0.02 step on
    # average): a few percent of rotated elements land one step away (H200: 3+ of 256 in a single row).
    assert torch.allclose(scale, want_scale, rtol=2**-7, atol=0)
    assert steps.max() <= 1 and (steps > 0).sum() <= max(4, (4e-2 if rotation else 2e-3) * steps.numel())


# Every ConvRot group in three row widths: one block of 256 (or one group of 1024), three of them (padded to the
# next power of two, behind the modulated LayerNorm), and one wide enough for the chunked path (17408 = 17 x 1024).
GROUP_CASES = [
    case
    for group in Q.ROTATION_GROUPS
    for case in (
        (group, 1, max(group, 256), "plain"),
        (group, 37, 3 * max(group, 256), "layer_norm"),
        (group, 3, 17408, "plain"),
    )
]


@pytest.mark.parametrize("group,m,k,mode", GROUP_CASES)
def test_every_convrot_group_matches_the_exact_rotation(kernel_device, mode, group, m, k):
    """The kernel's factored rotation (H_A . Y . H_B per group, tf32 dots) against the reference's exact fp32
    product with the whole regular Hadamard matrix, for every ConvRot group a file may use (ROTATION_GROUPS)."""
    x, kw = _inputs(mode, m, k, torch.bfloat16, kernel_device, seed=group + m)
    q, scale = Q.quantize_rows(x, "int8", group, **kw)
    want_q, want_scale = Q.quantize_rows_reference(x, "int8", group, **kw)
    steps = _step_diff(q, want_q, "int8")
    assert torch.allclose(scale, want_scale, rtol=2**-7, atol=0)
    assert steps.max() <= 1 and (steps > 0).sum() <= max(4, 4e-2 * steps.numel())
    if mode == "plain":  # and it is the rotation of that group: rotated back, the rows are the activation
        back = Q.rotate(q.float() * scale[:, None], group)
        assert ((back - x.float()).norm() / x.float().norm()).item() < 0.012


@pytest.mark.parametrize("fmt,rotation", [("int8", 0), ("fp8", 0), ("int8", 256)])
def test_quantized_rows_reconstruct_the_activation(kernel_device, fmt, rotation):
    x, _ = _inputs("plain", 64, 512, torch.bfloat16, kernel_device, seed=5)
    q, scale = Q.quantize_rows(x, fmt, rotation)
    back = q.float() * scale[:, None]
    if rotation:
        back = Q.rotate(back, rotation)  # H is its own inverse
    error = (back - x.float()).norm() / x.float().norm()
    assert error < {"int8": 0.012, "fp8": 0.04}[fmt]  # about one step of 127 (int8) or 2^-4 (e4m3) of each row


def test_zero_rows_quantise_to_zeros(kernel_device):
    x = torch.zeros(5, 256, device=kernel_device, dtype=torch.bfloat16)
    for fmt in Q.FORMATS:
        q, scale = Q.quantize_rows(x, fmt)
        assert torch.equal(q.float(), torch.zeros(5, 256, device=kernel_device)) and bool((scale > 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m,n", [(1, 64), (33, 300), (100, 512)])
def test_linear_epilogue_is_bit_identical(kernel_device, dtype, m, n):
    gen = torch.Generator().manual_seed(m * n)
    acc = torch.randint(-(2**24), 2**24, (m, n), generator=gen, dtype=torch.int32).to(kernel_device)
    row, col = (
        (torch.rand(m, generator=gen) * 1e-4).to(kernel_device),
        (torch.rand(n, generator=gen) * 1e-3).to(kernel_device),
    )
    residual = torch.randn(m, n, generator=gen).to(kernel_device, dtype)
    gate = torch.randn(3, n, generator=gen).to(kernel_device, dtype)
    y = (torch.randn(m, n, generator=gen) * 5).to(kernel_device, dtype)
    bias = torch.randn(n, generator=gen).to(kernel_device, dtype)
    per = -(-m // 3)
    cases = [
        dict(y=acc, row_scale=row, col_scale=col, out_dtype=dtype),
        dict(y=acc, row_scale=row, col_scale=col, residual=residual, gate=gate, rows_per_batch=per),
        dict(y=y, residual=residual, gate=gate, rows_per_batch=per),
        dict(y=y, bias=bias, residual=residual, gate=gate, rows_per_batch=per),  # the control branch's skip
        dict(y=acc, row_scale=row, col_scale=col, bias=bias, out_dtype=dtype),
    ]
    for case in cases:
        got = E.linear_epilogue(**case)
        want = E.linear_epilogue_reference(**case)
        assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    out = residual.clone()  # in place over the residual
    E.linear_epilogue(y, residual=out, gate=gate, rows_per_batch=per, out=out)
    assert torch.equal(out, E.linear_epilogue_reference(y, residual=residual, gate=gate, rows_per_batch=per))


def test_bad_inputs_are_named():
    x = torch.randn(4, 100)
    with pytest.raises(ValueError, match="rotation groups of 256 need a row width"):
        Q.quantize_rows(x, "int8", 256)
    with pytest.raises(ValueError, match=r"a ConvRot group of \(4, 16, 64, 256, 1024\), got 128"):
        Q.quantize_rows(torch.randn(4, 256), "int8", 128)
    with pytest.raises(ValueError, match="fmt must be one of"):
        Q.quantize_rows(x, "int4")
    with pytest.raises(ValueError, match="needs an int32 accumulator"):
        Q.quantize_rows(x, "int8", dequant=(torch.ones(4), torch.ones(100)))
    with pytest.raises(ValueError, match="an integer y"):
        E.linear_epilogue(torch.zeros(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="residual and gate go together"):
        E.linear_epilogue(torch.zeros(4, 8), residual=torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"bias must be \[N\]=8 contiguous torch.float32"):
        E.linear_epilogue(torch.zeros(4, 8), bias=torch.zeros(4))


def test_kernels_through_interpreter():
    child = triton_interpreter.run_under_interpreter(__file__, "-k", "not interpreter and not bad_inputs")
    assert " passed" in child.stdout and " failed" not in child.stdout, child.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _triton.TRITON_AVAILABLE, reason="needs a CUDA GPU and Triton")
def test_kernels_run_inside_a_cuda_graph():
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    Q.quantize_rows(x, "int8", 256)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = Q.quantize_rows(x, "int8", 256)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want_q, want_scale = Q.quantize_rows(x, "int8", 256)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)


# ---- the int8 GEMM with its fused epilogue -------------------------------------------------------------------


@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (37, 96, 160), (70, 300, 512)])  # odd M/N, K not a tile multiple
def test_int8_gemm_is_bit_identical_to_the_exact_product_and_epilogue(kernel_device, m, n, k):
    gen = torch.Generator().manual_seed(m + n + k)
    q = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8).to(kernel_device)
    weight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).to(kernel_device)
    scale = (torch.rand(m, generator=gen) * 1e-3).to(kernel_device)
    weight_scale = (torch.rand(n, generator=gen) * 1e-3).to(kernel_device)
    residual = torch.randn(m, n, generator=gen).to(kernel_device, torch.bfloat16)
    gate = torch.randn(2, n, generator=gen).to(kernel_device, torch.bfloat16)
    per = -(-m // 2)
    got = G.int8_linear(q, scale, weight, weight_scale)
    assert got.dtype == torch.bfloat16 and torch.equal(got, G.int8_linear_reference(q, scale, weight, weight_scale))
    fused = G.int8_linear(q, scale, weight, weight_scale, residual=residual, gate=gate, rows_per_batch=per)
    want = G.int8_linear_reference(q, scale, weight, weight_scale, residual=residual, gate=gate, rows_per_batch=per)
    assert torch.equal(fused, want)
    # the product really is the integer one: a change of one weight by one step moves the output
    weight[0, 0] = 127 if int(weight[0, 0]) != 127 else 126
    assert not torch.equal(G.int8_linear(q, scale, weight, weight_scale), got)


def test_int8_gemm_bad_inputs_are_named():
    q = torch.zeros(4, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="must be 2-D int8"):
        G.int8_linear(q.float(), torch.ones(4), torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match="one K"):
        G.int8_linear(q, torch.ones(4), torch.zeros(8, 32, dtype=torch.int8), torch.ones(8))
