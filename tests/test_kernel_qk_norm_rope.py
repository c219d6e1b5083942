"""Fused QK-RMSNorm + RoPE (+ K/V cache write) against the torch reference, and the dispatcher's gate.

The kernel runs wherever Triton can: on CUDA, and on CPU through the Triton interpreter. The interpreter
needs TRITON_INTERPRET=1 before Triton is first imported, which a shared pytest process cannot promise,
so `test_kernel_through_interpreter` reruns this file in a child process with it set; in the parent the
kernel tests skip on machines without a GPU, saying so. Gate and input-check tests run everywhere.

Tolerances (stated in kernels/qk_norm_rope.py): bit-identical where the fp32 sum of squares is exact in any
order; otherwise within 2 ulp (fp16/bf16) or 4 ulp (fp32) at the magnitude of each rotated pair, with
differences rare in half precision.
"""

from __future__ import annotations

import pytest
import torch
import triton_interpreter
from qwen21_nodes.kernels import _triton
from qwen21_nodes.kernels import qk_norm_rope as qnr

EPS = 1e-6
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ULP_BOUND = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@pytest.fixture
def kernel_device(monkeypatch):
    """The device the fused kernel runs on in this process; skips where it runs nowhere."""
    return triton_interpreter.kernel_device(
        monkeypatch, "no GPU here: these run on CPU in the child process of test_kernel_through_interpreter"
    )


@pytest.mark.slow  # a child process: imports the package again, then interprets the kernel (~15 s on 2 cores)
def test_kernel_through_interpreter():
    child = triton_interpreter.run_under_interpreter(__file__)
    # The kernel tests must have run there, not skipped (-ra lists skip reasons).
    assert " passed" in child.stdout and "child process of test_kernel" not in child.stdout, child.stdout


# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------


def _make_inputs(batch, seq, heads, head_dim, dtype, weight_dtype=None, device="cpu", integer_values=False):
    """qkv as the QKV GEMM would give it: a [B, S, 3, H, D] view of a [B, S, 3*H*D] row-major tensor."""
    gen = torch.Generator().manual_seed(batch * 1000 + seq * 100 + heads * 10 + head_dim)
    shape = (batch, seq, 3 * heads * head_dim)
    if integer_values:
        # Small integers: every partial sum of squares is exact in fp32, whatever the summation order.
        flat = torch.randint(-4, 5, shape, generator=gen).float()
    else:
        flat = torch.randn(shape, generator=gen) * (0.1 + 4 * torch.rand(batch, seq, 1, generator=gen))
    qkv = flat.to(dtype).view(batch, seq, 3, heads, head_dim)
    weight_dtype = weight_dtype or dtype
    q_weight = (0.25 + 2 * torch.rand(head_dim, generator=gen)).to(weight_dtype)
    k_weight = (2 * torch.randn(head_dim, generator=gen)).to(weight_dtype)
    angles = 40 * torch.randn(seq, head_dim // 2, generator=gen)
    tensors = [qkv, q_weight, k_weight, angles.cos(), angles.sin()]
    return [t.to(device) for t in tensors]


def _cache_slices(qkv, prefix=3, extra=2):
    """k_out / v_out as slices of preallocated [B, prefix + S + extra, H, D] caches filled with NaN."""
    batch, seq, _, heads, head_dim = qkv.shape
    caches = [
        torch.full((batch, prefix + seq + extra, heads, head_dim), float("nan"), dtype=qkv.dtype, device=qkv.device)
        for _ in range(2)
    ]
    return caches, [cache[:, prefix : prefix + seq] for cache in caches]


def _ulps_at_pair_magnitude(actual, expected):
    """|actual - expected| in units of the output dtype's ulp at the magnitude of each rotated pair."""
    expected32 = expected.float()
    magnitude = expected32.unflatten(-1, (-1, 2)).norm(dim=-1, keepdim=True)
    magnitude = magnitude.expand(*magnitude.shape[:-1], 2).flatten(-2)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude.clamp_min(1e-30)))) * torch.finfo(expected.dtype).eps
    return (actual.float() - expected32).abs() / ulp


def _reference(qkv, q_weight, k_weight, cos, sin):
    return qnr.qk_norm_rope_reference(qkv[:, :, 0], qkv[:, :, 1], q_weight, k_weight, cos, sin, EPS)


# ---------------------------------------------------------------------------------------------------------
# Kernel numerics
# ---------------------------------------------------------------------------------------------------------

# (batch, seq, heads, head_dim, dtype): odd lengths, batch 1 and 2, 1 and 32 heads, small head dims and
# 128 at tiny S, every dtype; (3 heads, head_dim 24) leaves masked lanes in both tile dimensions.
CASES = [
    (1, 5, 32, 32, torch.bfloat16),
    (2, 3, 1, 16, torch.float16),
    (2, 3, 3, 24, torch.float32),
    (1, 3, 32, 128, torch.bfloat16),
    (1, 1, 32, 128, torch.float16),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_fused_matches_reference(kernel_device, case):
    *shape, dtype = case
    qkv, q_weight, k_weight, cos, sin = _make_inputs(*shape, dtype, device=kernel_device)
    caches, (k_out, v_out) = _cache_slices(qkv)
    q, k, v = qnr.qk_norm_rope_fused(qkv, q_weight, k_weight, cos, sin, EPS, k_out=k_out, v_out=v_out)
    q_ref, k_ref = _reference(qkv, q_weight, k_weight, cos, sin)

    assert k is k_out and v is v_out
    for name, got, want in (("q", q, q_ref), ("k", k, k_ref)):
        ulps = _ulps_at_pair_magnitude(got, want)
        assert ulps.max() <= ULP_BOUND[dtype], f"{name}: {ulps.max().item()} ulp"
        if dtype != torch.float32:
            assert (got != want).float().mean() <= 0.01, f"{name}: too many elements differ"
    assert torch.equal(v_out, qkv[:, :, 2])
    prefix, seq = 3, qkv.shape[1]
    for cache in caches:  # nothing written outside the slice
        assert cache[:, :prefix].isnan().all() and cache[:, prefix + seq :].isnan().all()


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [(d, d) for d in DTYPES] + [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)],
    ids=str,
)
def test_bit_identical_when_sum_of_squares_is_exact(kernel_device, dtype, weight_dtype):
    # With the summation order out of play, every rounding must match the reference's.
    qkv, q_weight, k_weight, cos, sin = _make_inputs(
        1, 3, 4, 32, dtype, weight_dtype, device=kernel_device, integer_values=True
    )
    q, k, _ = qnr.qk_norm_rope_fused(qkv, q_weight, k_weight, cos, sin, EPS)
    q_ref, k_ref = _reference(qkv, q_weight, k_weight, cos, sin)
    assert torch.equal(q, q_ref)
    assert torch.equal(k, k_ref)


def test_any_strides(kernel_device):
    # qkv with a non-unit last stride, rope tables cut from wider ones, k_out/v_out transposed views.
    batch, seq, heads, head_dim = 2, 3, 2, 16
    qkv_wide, q_weight, k_weight, cos_wide, sin_wide = _make_inputs(
        batch, seq, heads, 2 * head_dim, torch.float16, device=kernel_device
    )
    qkv = qkv_wide[..., ::2]
    q_weight, k_weight = q_weight[:head_dim], k_weight[:head_dim]
    cos, sin = cos_wide[:, 1 : 1 + head_dim // 2], sin_wide[:, 1 : 1 + head_dim // 2]
    k_out = torch.empty(batch, heads, seq, head_dim, dtype=qkv.dtype, device=kernel_device).transpose(1, 2)
    v_out = torch.empty_like(k_out)

    q, k, v = qnr.qk_norm_rope_fused(qkv, q_weight, k_weight, cos, sin, EPS, k_out=k_out, v_out=v_out)
    q_ref, k_ref = _reference(qkv, q_weight, k_weight, cos, sin)
    assert _ulps_at_pair_magnitude(q, q_ref).max() <= ULP_BOUND[torch.float16]
    assert _ulps_at_pair_magnitude(k, k_ref).max() <= ULP_BOUND[torch.float16]
    assert torch.equal(v, qkv[:, :, 2])


def test_without_cache_outputs_k_is_new_and_v_is_a_view(kernel_device):
    qkv, q_weight, k_weight, cos, sin = _make_inputs(1, 4, 2, 16, torch.bfloat16, device=kernel_device)
    q, k, v = qnr.qk_norm_rope(qkv, q_weight, k_weight, cos, sin, EPS, min_tokens=0)
    assert q.shape == k.shape == v.shape == (1, 4, 2, 16)
    assert q.is_contiguous() and k.is_contiguous()
    assert v.data_ptr() == qkv[:, :, 2].data_ptr() and v.stride() == qkv[:, :, 2].stride()
    k_ref = _reference(qkv, q_weight, k_weight, cos, sin)[1]
    assert _ulps_at_pair_magnitude(k, k_ref).max() <= ULP_BOUND[torch.bfloat16]


@pytest.mark.gpu
def test_full_size_on_gpu_and_in_a_cuda_graph():
    if not _triton.triton_runs_on(torch.device("cuda")):
        pytest.skip("needs Triton on CUDA (and TRITON_INTERPRET unset)")
    qkv, q_weight, k_weight, cos, sin = _make_inputs(1, 333, 32, 128, torch.bfloat16, device="cuda")
    _, (k_out, v_out) = _cache_slices(qkv, prefix=100, extra=0)
    q, k, v = qnr.qk_norm_rope_fused(qkv, q_weight, k_weight, cos, sin, EPS, k_out=k_out, v_out=v_out)
    q_ref, k_ref = _reference(qkv, q_weight, k_weight, cos, sin)
    for got, want in ((q, q_ref), (k, k_ref)):
        assert _ulps_at_pair_magnitude(got, want).max() <= ULP_BOUND[torch.bfloat16]
        assert (got != want).float().mean() <= 1e-3
    assert torch.equal(v, qkv[:, :, 2])

    # Captured with the in-graph gate, replayed on new data: the same bits as an eager call.
    static_qkv = qkv.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_q, _, _ = qnr.qk_norm_rope(
            static_qkv, q_weight, k_weight, cos, sin, EPS, k_out=k_out, v_out=v_out, min_tokens=0, in_graph=True
        )
    static_qkv.copy_(torch.randn_like(qkv))
    graph.replay()
    eager_q, eager_k, _ = qnr.qk_norm_rope_fused(static_qkv, q_weight, k_weight, cos, sin, EPS)
    assert torch.equal(graph_q, eager_q) and torch.equal(k_out, eager_k)
    assert torch.equal(v_out, static_qkv[:, :, 2])


# ---------------------------------------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def path_taken(monkeypatch):
    """Pretends Triton runs here and records which path each qk_norm_rope call takes."""
    taken = []
    reference = qnr.qk_norm_rope_reference

    def fake_fused(qkv, *args):
        taken.append("fused")
        return reference(qkv[:, :, 0], qkv[:, :, 1], *args[:5]) + (qkv[:, :, 2],)

    def spy_reference(*args):
        taken.append("reference")
        return reference(*args)

    monkeypatch.setattr(qnr, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(qnr, "_launch_fused", fake_fused)
    monkeypatch.setattr(qnr, "qk_norm_rope_reference", spy_reference)

    def call(batch, seq, **kwargs):
        inputs = _make_inputs(batch, seq, 1, 4, torch.float32)
        qnr.qk_norm_rope(*inputs, EPS, **kwargs)
        return taken.pop()

    return call


def test_gate_default_threshold(path_taken):
    threshold = qnr.DEFAULT_MIN_TOKENS
    assert path_taken(1, max(threshold, 1)) == "fused"
    if threshold > 0:
        assert path_taken(1, threshold - 1) == "reference"


def test_gate_threshold_counts_batch_times_seq(path_taken):
    assert path_taken(1, 7, min_tokens=8) == "reference"
    assert path_taken(1, 8, min_tokens=8) == "fused"
    assert path_taken(2, 4, min_tokens=8) == "fused"
    assert path_taken(2, 3, min_tokens=8) == "reference"


def test_gate_zero_means_always(path_taken):
    assert path_taken(1, 1, min_tokens=0) == "fused"


def test_gate_in_graph_has_its_own_default(path_taken, monkeypatch):
    monkeypatch.setattr(qnr, "DEFAULT_MIN_TOKENS", 0)
    monkeypatch.setattr(qnr, "DEFAULT_MIN_TOKENS_IN_GRAPH", 6)
    assert path_taken(1, 5, in_graph=True) == "reference"
    assert path_taken(1, 6, in_graph=True) == "fused"
    assert path_taken(1, 5) == "fused"
    assert qnr.fusion_min_tokens(in_graph=True) == 6 and qnr.fusion_min_tokens() == 0
    assert path_taken(1, 3, in_graph=True, min_tokens=4) == "reference"


def test_gate_uses_reference_where_triton_cannot_run(path_taken, monkeypatch):
    monkeypatch.setattr(qnr, "triton_runs_on", lambda device: False)
    assert path_taken(1, 5, min_tokens=0) == "reference"


@pytest.mark.parametrize("value", [-1, 1.5, True, "8"])
def test_gate_rejects_bad_min_tokens(value):
    inputs = _make_inputs(1, 2, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="min_tokens"):
        qnr.qk_norm_rope(*inputs, EPS, min_tokens=value)


def test_reference_path_writes_cache_like_before():
    qkv, q_weight, k_weight, cos, sin = _make_inputs(2, 3, 2, 8, torch.bfloat16)
    _, (k_out, v_out) = _cache_slices(qkv)
    q, k, v = qnr.qk_norm_rope(qkv, q_weight, k_weight, cos, sin, EPS, k_out, v_out, min_tokens=10**9)
    q_ref, k_ref = _reference(qkv, q_weight, k_weight, cos, sin)
    assert k is k_out and v is v_out
    assert torch.equal(q, q_ref) and torch.equal(k_out, k_ref) and torch.equal(v_out, qkv[:, :, 2])


# ---------------------------------------------------------------------------------------------------------
# Input checks: both paths reject the same inputs with a message naming the input
# ---------------------------------------------------------------------------------------------------------


def _bad_inputs(case):
    qkv, q_weight, k_weight, cos, sin = _make_inputs(1, 3, 2, 8, torch.float32)
    k_out = v_out = None
    if case == "qkv_not_5d":
        qkv = qkv.flatten(2)
    elif case == "qkv_not_3_parts":
        qkv = qkv[:, :, :2]
    elif case == "qkv_int":
        qkv = qkv.to(torch.int32)
    elif case == "qkv_odd_head_dim":
        qkv = qkv[..., :7]
    elif case == "q_weight_shape":
        q_weight = q_weight[:4]
    elif case == "k_weight_dtype":
        k_weight = k_weight.to(torch.bfloat16)
    elif case == "cos_shape":
        cos = cos[:2]
    elif case == "sin_dtype":
        sin = sin.to(torch.bfloat16)
    elif case == "k_out_shape":
        k_out = torch.empty(1, 3, 2, 4)
    elif case == "v_out_dtype":
        v_out = torch.empty(1, 3, 2, 8, dtype=torch.bfloat16)
    elif case == "k_out_device":
        k_out = torch.empty(1, 3, 2, 8, device="meta")
    elif case == "cos_not_tensor":
        cos = cos.tolist()
    return (qkv, q_weight, k_weight, cos, sin, EPS, k_out, v_out)


BAD_CASES = {
    "qkv_not_5d": (ValueError, "qkv"),
    "qkv_not_3_parts": (ValueError, "qkv"),
    "qkv_int": (TypeError, "qkv"),
    "qkv_odd_head_dim": (ValueError, "head_dim"),
    "q_weight_shape": (ValueError, "q_weight"),
    "k_weight_dtype": (TypeError, "k_weight"),
    "cos_shape": (ValueError, "cos"),
    "sin_dtype": (TypeError, "sin"),
    "k_out_shape": (ValueError, "k_out"),
    "v_out_dtype": (TypeError, "v_out"),
    "k_out_device": (ValueError, "k_out"),
    "cos_not_tensor": (TypeError, "cos"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
@pytest.mark.parametrize("min_tokens", [0, 10**9], ids=["fused_gate", "reference_gate"])
def test_bad_inputs_raise_clear_errors(case, min_tokens):
    error, name = BAD_CASES[case]
    with pytest.raises(error, match=name):
        qnr.qk_norm_rope(*_bad_inputs(case), min_tokens=min_tokens)


def test_fused_entry_refuses_devices_triton_cannot_run_on(monkeypatch):
    monkeypatch.setattr(qnr, "triton_runs_on", lambda device: False)
    with pytest.raises(RuntimeError, match="Triton cannot run"):
        qnr.qk_norm_rope_fused(*_make_inputs(1, 2, 1, 4, torch.float32), EPS)
