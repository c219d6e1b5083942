"""The weight dequantisation kernel against torch's expression `(q.float() * scale[:, None]).to(dtype)`: bit for bit
for fp8 and int8 storage, every output dtype, odd shapes and `out=`; its input checks; and the gate that keeps
torch's expression until the kernel is compiled (kernels/dequantize_weight.py), with the warm-up's jobs.

The kernel runs on CUDA, and on CPU through the Triton interpreter in the child process of
`test_kernels_through_interpreter` (see triton_interpreter.py); in the parent those tests skip without a GPU. The
gate's tests stand a recording launcher in for the kernel, so they run anywhere.
"""

from __future__ import annotations

import logging

import pytest
import torch
import triton_interpreter
from qwen21_nodes.kernels import _triton
from qwen21_nodes.kernels import dequantize_weight as D
from qwen21_nodes.qwen21_core.quant.kernel_warmup import dequantize_keys, dequantize_warmup_jobs
from qwen21_nodes.qwen21_core.quant.linear import QuantLinear
from qwen21_nodes.qwen21_core.quant.weights import QuantFormat
from qwen21_nodes.qwen21_core.startup.warmup import KernelWarmup

FP8, INT8 = torch.float8_e4m3fn, torch.int8


@pytest.fixture(autouse=True)
def fresh_gate():
    """Every test starts with no key's state."""
    D.clear()
    yield
    D.clear()


@pytest.fixture
def kernel_device(monkeypatch):
    return triton_interpreter.kernel_device(
        monkeypatch, "no GPU here: the kernel runs on CPU in the child process of test_kernels_through_interpreter"
    )


def _weight(n: int, k: int, q_dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, k] over the whole storage range (for fp8 every bit pattern, NaN and subnormals included) and scales
    from 1e-8 to 1e3, so fp16 outputs meet subnormals and overflow and bf16 ones every rounding case."""
    gen = torch.Generator().manual_seed(seed)
    if q_dtype == FP8:
        bits = torch.randint(0, 256, (n * k,), generator=gen, dtype=torch.uint8)
        bits[: min(256, n * k)] = torch.arange(min(256, n * k), dtype=torch.uint8)  # every pattern where it fits
        q = bits.view(FP8).reshape(n, k)
    else:
        q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.exp(torch.empty(n).uniform_(-18.4, 6.9, generator=gen))
    return q, scale


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _triton.same_bits(a.float(), b.float())


# ---- the kernel ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_dtype", [FP8, INT8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,k", [(1, 16), (37, 203), (6, 544), (130, 1)])  # rows and columns not tile multiples
def test_kernel_is_bit_identical_to_torchs_expression(kernel_device, q_dtype, dtype, n, k):
    q, scale = _weight(n, k, q_dtype, seed=n * k)
    q, scale = q.to(kernel_device), scale.to(kernel_device)
    got = D.dequantize_weight_fast(q, scale, dtype)
    want = (q.float() * scale[:, None]).to(dtype)
    assert _same_bits(got, want)
    if q_dtype == FP8 and n * k >= 256:
        assert torch.isnan(want.float()).any()  # every fp8 bit pattern went through, NaN included


@pytest.mark.parametrize("q_dtype", [FP8, INT8])
def test_out_argument_is_written_and_returned(kernel_device, q_dtype):
    q, scale = _weight(9, 80, q_dtype, seed=3)
    q, scale = q.to(kernel_device), scale.to(kernel_device)
    out = torch.full((9, 80), 7.0, dtype=torch.bfloat16, device=kernel_device)
    got = D.dequantize_weight_fast(q, scale, torch.bfloat16, out=out)
    assert got is out and _same_bits(out, D.dequantize_weight_reference(q, scale, torch.bfloat16))


def test_warm_up_compiles_checks_and_opens_the_gate(kernel_device):
    assert not D.ready(kernel_device, INT8, torch.bfloat16)
    assert D.warm_up(kernel_device, INT8, torch.bfloat16)
    assert D.ready(kernel_device, INT8, torch.bfloat16) and not D.ready(kernel_device, FP8, torch.bfloat16)


def test_bad_inputs_are_named():
    q, scale = _weight(4, 32, INT8)
    cases = [
        ((q.float(), scale, torch.bfloat16), r"q must be a contiguous 2-D tensor of .*got torch.float32 \(4, 32\)"),
        ((q.t(), scale, torch.bfloat16), r"q must be a contiguous .*\(not contiguous\)"),
        ((q[None], scale, torch.bfloat16), r"q must be a contiguous 2-D .*\(1, 4, 32\)"),
        ((q, scale[:3], torch.bfloat16), r"scale must be float32 \[4\] \(one per row of q\), got torch.float32 \(3,\)"),
        ((q, scale.bfloat16(), torch.bfloat16), r"scale must be float32 \[4\].*got torch.bfloat16"),
        ((q, scale, torch.int32), r"dtype must be one of .*got torch.int32"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            D.dequantize_weight_fast(*args)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 \[4, 32\].*got torch.float16"):
        D.dequantize_weight_fast(q, scale, torch.bfloat16, out=torch.empty(4, 32, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.bfloat16 \[4, 32\].*\(32, 4\)"):
        D.dequantize_weight_fast(q, scale, torch.bfloat16, out=torch.empty(32, 4, dtype=torch.bfloat16))


def test_kernels_through_interpreter():
    tests = "torchs_expression or out_argument or warm_up_compiles"
    child = triton_interpreter.run_under_interpreter(__file__, "-k", tests)
    assert " passed" in child.stdout and " failed" not in child.stdout and " skipped" not in child.stdout, child.stdout


# ---- the gate ---------------------------------------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """A recording launcher in place of the kernel (it computes torch's result), Triton said to run on the CPU."""
    calls = []

    def launch(q, scale, out):
        calls.append((q.dtype, out.dtype, tuple(q.shape)))
        return out.copy_(D.dequantize_weight_reference(q, scale, out.dtype))

    monkeypatch.setattr(D, "_launch", launch)
    monkeypatch.setattr(D, "triton_runs_on", lambda device: True)
    return calls


def test_gate_uses_torch_while_the_warm_up_is_pending_and_the_kernel_once_it_is_ready(launches):
    q, scale = _weight(8, 64, FP8)
    want = D.dequantize_weight_reference(q, scale, torch.bfloat16)
    D.expect_warm_up("cpu", FP8, torch.bfloat16)
    assert _same_bits(D.dequantize_for_linear(q, scale, torch.bfloat16), want) and launches == []
    assert D.warm_up("cpu", FP8, torch.bfloat16) and launches == [(FP8, torch.bfloat16, D.WARMUP_SHAPE)]
    assert _same_bits(D.dequantize_for_linear(q, scale, torch.bfloat16), want)
    assert launches[1:] == [(FP8, torch.bfloat16, (8, 64))]
    D.dequantize_for_linear(q, scale, torch.float16)  # another output dtype: a key of its own, nobody warms it up
    assert launches[2:] == [(FP8, torch.float16, (8, 64))] and D.ready("cpu", FP8, torch.float16)


def test_gate_keeps_torch_for_a_variant_the_warm_up_does_not_compile(launches):
    D.expect_warm_up("cpu", INT8, torch.bfloat16)
    D.warm_up("cpu", INT8, torch.bfloat16)
    launches.clear()
    q, scale = _weight(8, 72, INT8)  # K not a multiple of 16
    want = D.dequantize_weight_reference(q, scale, torch.bfloat16)
    assert _same_bits(D.dequantize_for_linear(q, scale, torch.bfloat16), want)
    q, scale = _weight(8, 64, INT8)
    D.dequantize_for_linear(q, scale.to(torch.float64), torch.bfloat16)  # not the kernel's input
    assert launches == []


def test_a_failing_launch_is_logged_once_and_torch_serves_on(monkeypatch, launches, caplog):
    def broken(q, scale, out):
        launches.append("broken")
        raise RuntimeError("no ptxas here")

    monkeypatch.setattr(D, "_launch", broken)
    q, scale = _weight(8, 64, INT8)
    want = D.dequantize_weight_reference(q, scale, torch.float16)
    with caplog.at_level(logging.WARNING):
        assert _same_bits(D.dequantize_for_linear(q, scale, torch.float16), want)
        assert _same_bits(D.dequantize_for_linear(q, scale, torch.float16), want)
    assert launches == ["broken"] and caplog.text.count("no ptxas here") == 1
    assert not D.ready("cpu", INT8, torch.float16)


def test_a_warm_up_whose_bits_differ_leaves_the_gate_shut(monkeypatch, launches, caplog):
    monkeypatch.setattr(D, "_launch", lambda q, scale, out: out.fill_(1.0))
    D.expect_warm_up("cpu", FP8, torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        assert not D.warm_up("cpu", FP8, torch.bfloat16)
    assert "differs from torch's" in caplog.text and not D.ready("cpu", FP8, torch.bfloat16)
    q, scale = _weight(8, 64, FP8)
    assert _same_bits(D.dequantize_for_linear(q, scale, torch.bfloat16),
                      D.dequantize_weight_reference(q, scale, torch.bfloat16))  # fmt: skip


def test_quant_linear_on_the_cpu_keeps_torchs_expression(launches):
    torch.manual_seed(0)
    layer = QuantLinear.from_weight(torch.randn(32, 64), QuantFormat("fp8"), quantize_activations=False)
    with D.forced("cpu", FP8, torch.float32, use_kernel=True):
        weight = layer.dequantized_weight(torch.float32)
    assert launches == [] and torch.equal(weight, layer.qweight.float() * layer.weight_scale[:, None])


def test_forced_restores_the_state_before():
    D.expect_warm_up("cpu", INT8, torch.bfloat16)
    with D.forced("cpu", INT8, torch.bfloat16, use_kernel=True):
        assert D.ready("cpu", INT8, torch.bfloat16)
    assert not D.ready("cpu", INT8, torch.bfloat16) and D._states == {("cpu", INT8, torch.bfloat16): "pending"}


def test_warm_up_jobs_one_per_key_of_the_models_cuda_layers(monkeypatch):
    ran = []
    monkeypatch.setattr(D, "warm_up", lambda *key: ran.append(key))
    fp8, int8 = QuantFormat("fp8"), QuantFormat("int8")
    text = torch.nn.Sequential(QuantLinear(64, 32, fp8), QuantLinear(64, 32, fp8), torch.nn.Linear(4, 4))
    dit = torch.nn.Sequential(QuantLinear(64, 32, fp8), QuantLinear(64, 32, int8, compute_dtype=torch.float16))
    cuda = torch.device("cuda:0")
    models = [(text, cuda), (dit, cuda), (dit, torch.device("cpu")), (None, cuda)]
    want = [(cuda, FP8, torch.bfloat16), (cuda, INT8, torch.float16)]
    assert dequantize_keys(models) == want
    jobs = dequantize_warmup_jobs(models)
    assert D._states == {("cuda:0", FP8, torch.bfloat16): "pending", ("cuda:0", INT8, torch.float16): "pending"}
    KernelWarmup({"text": jobs}, torch.device("cpu"), threads=2).start().wait()
    assert sorted(ran, key=str) == sorted(want, key=str)


# ---- on the GPU -------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _triton.TRITON_AVAILABLE,
                                reason="needs a CUDA GPU and Triton")  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("q_dtype", [FP8, INT8])
def test_cuda_kernel_is_bit_identical_at_a_real_layer_shape(q_dtype):
    q, scale = _weight(4096, 12288, q_dtype, seed=1)  # the text encoder's MLP down-projection
    q, scale = q.cuda(), scale.cuda()
    got = D.dequantize_weight_fast(q, scale, torch.bfloat16)
    assert _same_bits(got, (q.float() * scale[:, None]).to(torch.bfloat16))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_cuda_quant_linear_forward_is_unchanged_by_the_kernel(monkeypatch, fmt):
    torch.manual_seed(0)
    layer = QuantLinear.from_weight(torch.randn(1536, 4096, device="cuda", dtype=torch.bfloat16), QuantFormat(fmt),
                                    quantize_activations=False)  # fmt: skip
    x = torch.randn(2, 77, 4096, device="cuda", dtype=torch.bfloat16)
    key = (x.device, layer.qweight.dtype, torch.bfloat16)
    with D.forced(*key, use_kernel=False):
        want = layer(x)
    launched = []
    real = D._launch
    monkeypatch.setattr(D, "_launch", lambda *args: launched.append(1) or real(*args))
    assert D.warm_up(*key) and D.ready(*key)
    assert torch.equal(layer(x), want) and len(launched) == 2  # the warm-up's launch and the layer's


@pytest.mark.gpu
@needs_cuda
def test_cuda_warm_up_part_opens_the_gate_and_the_kernel_runs_in_a_cuda_graph():
    layer = QuantLinear.from_weight(torch.randn(256, 512, device="cuda", dtype=torch.bfloat16), QuantFormat("fp8"),
                                    quantize_activations=False)  # fmt: skip
    device = layer.qweight.device
    warmup = KernelWarmup({"text": dequantize_warmup_jobs([(layer, device)])}, device)
    assert not D.ready(device, FP8, torch.bfloat16)  # pending until the job ran
    warmup.start().wait()
    assert D.ready(device, FP8, torch.bfloat16) and not warmup.failures
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weight = layer.dequantized_weight(torch.bfloat16)
    with torch.no_grad():
        layer.qweight.copy_(torch.randn(256, 512, device="cuda").to(FP8))
    graph.replay()
    assert _same_bits(weight, D.dequantize_weight_reference(layer.qweight, layer.weight_scale, torch.bfloat16))


def test_the_kernel_serves_at_every_row_count_unless_forced_off(monkeypatch, launches):
    """Measured on the H200 (bench_text_encoder --dequant): with the direct launch the kernel made a 101-token encode
    1.469x faster and a 1131-token one 1.103x, so it serves whatever the row count; a benchmark's comparison can still
    force it off (or on)."""
    q, scale = _weight(8, 32, FP8)
    want = D.dequantize_weight_reference(q, scale, torch.bfloat16)
    D.warm_up("cpu", FP8, torch.bfloat16)
    launches.clear()
    assert _same_bits(D.dequantize_for_linear(q, scale, torch.bfloat16), want)
    assert len(launches) == 1
    # a weight-only layer multiplying one row goes through the kernel too
    layer = QuantLinear.from_weight(torch.randn(32, 64), QuantFormat("fp8"), quantize_activations=False)
    monkeypatch.setattr(type(layer.qweight), "is_cuda", property(lambda self: True))
    D.warm_up("cpu", layer.qweight.dtype, torch.float32)
    launches.clear()
    layer(torch.randn(1, 64))
    assert len(launches) == 1
    with D.forced("cpu", FP8, torch.bfloat16, use_kernel=False):
        assert _same_bits(D.dequantize_for_linear(q, scale, torch.bfloat16), want) and len(launches) == 1
    D.dequantize_for_linear(q, scale, torch.bfloat16)
    assert len(launches) == 2
