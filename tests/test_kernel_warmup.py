"""The background kernel warm-up: parts run side by side, a failing job is logged and never raised, waiting blocks
until a part is done; the DiT's and the VAE's warm-up jobs run the real step math on copies (CPU here: torch's
references; on the GPU the same calls compile the Triton kernels, checked by the GPU test)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import types

import pytest
import torch
from qwen21_nodes.kernels import launch_configs
from qwen21_nodes.qwen21_core.dit.kernel_warmup import FIRST_BUCKETS, PART, bucket_part, dit_warmup_parts, later_buckets
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer
from qwen21_nodes.qwen21_core.startup import model_warmup
from qwen21_nodes.qwen21_core.startup.warmup import MAX_THREADS, KernelWarmup
from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER, TINY_VAE
from qwen21_nodes.qwen21_core.vae.kernel_warmup import vae_warmup_jobs
from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE


def test_parts_run_side_by_side_and_wait_blocks_until_done():
    gate = threading.Event()
    ran = []

    def slow():
        gate.wait(5)
        ran.append("slow")

    warmup = KernelWarmup({"a": [slow], "b": [lambda: ran.append("b1"), lambda: ran.append("b2")]},
                          torch.device("cpu"), threads=2).start()  # fmt: skip
    warmup.wait("b")  # b does not wait for a
    assert sorted(ran) == ["b1", "b2"] and not warmup.done("a")
    assert warmup.busy()  # one part left is enough
    gate.set()
    warmup.wait()
    assert sorted(ran) == ["b1", "b2", "slow"] and warmup.done("a")
    assert not warmup.busy()
    assert set(warmup.seconds) == {"a", "b"}


def test_the_second_stage_is_queued_only_once_every_first_part_is_done():
    """The parts a first image waits for run alone first: the others would take the interpreter from them and from
    the first encode (a restart's first image, BENCHMARKS "Session")."""
    gate = threading.Event()
    ran = []

    def first_job():
        gate.wait(5)
        ran.append("dit")

    warmup = KernelWarmup({"text": [], "dit": [first_job], "vae": [lambda: ran.append("vae")],
                           "dit:16": [lambda: ran.append("dit:16")]}, torch.device("cpu"), threads=4,
                          first=("text", "dit"))  # fmt: skip
    warmup.start()
    time.sleep(0.2)
    assert ran == [] and warmup.done("text") and not warmup.done("vae")  # four threads, yet the rest waits
    gate.set()
    warmup.wait()
    assert ran[0] == "dit" and sorted(ran[1:]) == ["dit:16", "vae"]
    assert warmup.seconds["vae"] >= warmup.seconds["dit"]


def test_no_job_starts_while_paused_unless_someone_waits():
    """The first encode pauses the warm-up (its Python shares the interpreter's lock with every job's): jobs queued
    meanwhile start once it is done, or at once when someone waits for a part, so a wait inside a pause cannot hang."""
    ran = []
    warmup = KernelWarmup({"dit": [lambda: ran.append("dit")], "vae": [lambda: ran.append("vae")]},
                          torch.device("cpu"), threads=2)  # fmt: skip
    with warmup.paused():
        warmup.start()
        time.sleep(0.2)
        assert ran == [] and warmup.busy()
        assert warmup.wait("dit") >= 0 and "dit" in ran  # waiting lifts the pause
    warmup.wait()
    assert sorted(ran) == ["dit", "vae"]
    with warmup.paused():  # nested use and an idle warm-up: nothing to block
        with warmup.paused():
            pass
    assert warmup._may_start.is_set()


def test_without_first_parts_every_part_is_queued_at_start():
    gate = threading.Event()
    warmup = KernelWarmup({"a": [lambda: gate.wait(5)], "b": [lambda: None]}, torch.device("cpu"), threads=2,
                          first=("missing",)).start()  # fmt: skip
    warmup.wait("b")
    gate.set()
    warmup.wait()
    assert warmup.first == ()


def test_a_failing_job_is_logged_and_never_raises(caplog):
    ran = []

    def broken():
        raise RuntimeError("no compiler here")

    with caplog.at_level(logging.WARNING):
        warmup = KernelWarmup({"dit": [broken], "vae": [lambda: ran.append(2)]}, torch.device("cpu"), threads=1)
        warmup.start().wait()
    assert ran == [2]  # the other part ran
    assert "no compiler here" in warmup.failures["dit"] and "compile on first use" in caplog.text
    assert warmup.done("dit") and warmup.done("vae")


def test_the_pool_size_comes_from_the_settings_else_from_the_cores(use_settings):
    use_settings(kernel_warmup_threads=2)
    assert KernelWarmup({}, torch.device("cpu")).threads == 2
    assert KernelWarmup({}, torch.device("cpu"), threads=3).threads == 3  # the caller's choice first
    use_settings(kernel_warmup_threads=None)
    assert 1 <= KernelWarmup({}, torch.device("cpu")).threads <= MAX_THREADS


def test_wait_before_start_returns_at_once():
    warmup = KernelWarmup({"dit": [lambda: time.sleep(10)]}, torch.device("cpu"))
    assert warmup.wait() == 0.0
    assert not warmup.busy()  # not started: no thread takes the interpreter


def test_the_first_images_buckets_and_the_later_ones_cover_every_bucket_once():
    order = [*FIRST_BUCKETS, *later_buckets()]
    assert order[:3] == [4096, 128, 256]
    assert sorted(order) == launch_configs.all_buckets()


def test_dit_jobs_run_the_step_math_on_a_copy_under_each_bucket(monkeypatch):
    torch.manual_seed(0)
    model = QwenImage21Transformer(TINY_TRANSFORMER).eval()
    before = {name: p.clone() for name, p in model.named_parameters()}
    seen = []
    real = launch_configs.forced_bucket

    def spy(bucket):
        seen.append(bucket)
        return real(bucket)

    monkeypatch.setattr("qwen21_nodes.qwen21_core.dit.kernel_warmup.forced_bucket", spy)
    parts = dit_warmup_parts(model, torch.device("cpu"))
    # the first part: the attention kernels once (at the first bucket), the first buckets' QKV projection and
    # finish, the K/V formats; then one part per later bucket
    assert list(parts) == [PART, *(bucket_part(b) for b in later_buckets())]
    for job in parts[PART]:
        job()
    assert seen == [4096] + [b for b in (4096, 128, 256) for _ in ("qkv", "finish")]
    assert len(parts[PART]) == len(seen) + 1
    seen.clear()
    for bucket in later_buckets():
        for job in parts[bucket_part(bucket)]:
            job()
    assert seen == [b for b in later_buckets() for _ in ("qkv", "finish")]
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())


def test_forced_bucket_is_per_thread_and_restored():
    kernel = launch_configs.TunedKernel("toy", ("M_BUCKET",), rule=lambda key: launch_configs.LaunchConfig.of(
        key["M_BUCKET"] // 16), candidates=lambda key: [])  # fmt: skip
    launched = []

    class Fn:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs["num_warps"])

    def launch(rows):
        key = {"M_BUCKET": launch_configs.m_bucket(rows)}
        kernel.launch(Fn(), lambda config: (1,), (), {}, key, torch.device("cpu"))

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(launch_configs, "architecture", lambda device: "sm_00")
    try:
        with launch_configs.forced_bucket(4096):
            launch(16)
            other = threading.Thread(target=launch, args=(16,))
            other.start()
            other.join()
        launch(16)
    finally:
        monkeypatch.undo()
    assert launched == [256, 1, 1]  # forced in this thread only, and gone after the block


def test_a_launch_waits_for_its_buckets_pending_compiles_only(monkeypatch):
    """The sampler waits for the DiT's first part only; a later bucket's launch waits for that bucket's warm-up part
    (never compiling it twice at once), other buckets and the warm-up's own forced launches do not wait."""
    kernel = launch_configs.TunedKernel("toy_pending", ("M_BUCKET",), rule=lambda key: launch_configs.LaunchConfig.of(
        4), candidates=lambda key: [])  # fmt: skip
    launched = []

    class Fn:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(threading.current_thread().name)

    def launch(rows):
        key = {"M_BUCKET": launch_configs.m_bucket(rows)}
        kernel.launch(Fn(), lambda config: (1,), (), {}, key, torch.device("cpu"))

    monkeypatch.setattr(launch_configs, "architecture", lambda device: "sm_00")
    monkeypatch.setattr(launch_configs, "_bucket_gate", None)
    pending = model_warmup.PendingBuckets()
    compiled = threading.Event()
    warmup = KernelWarmup({"dit:8192": [lambda: compiled.wait(30)]}, torch.device("cpu"), threads=1,
                          on_part_done=pending.forget_done)  # fmt: skip
    pending.expect(warmup, {8192: "dit:8192"})
    warmup.start()
    assert launch_configs._bucket_gate == pending.wait_for  # the kernels' one hook, set while a bucket is pending
    launch(100)  # bucket 128: nothing pending
    with launch_configs.forced_bucket(8192):
        launch(16)  # the warm-up's own launch of the pending bucket
    waiting = threading.Thread(target=launch, args=(5000,), name="sampler")
    waiting.start()
    waiting.join(0.3)
    assert waiting.is_alive() and launched == ["MainThread", "MainThread"]  # bucket 8192 waits
    compiled.set()
    waiting.join(5)
    assert not waiting.is_alive() and launched[-1] == "sampler"
    assert pending._parts == {} and launch_configs._bucket_gate is None  # done: forgotten, the gate removed
    launch(5000)
    assert launched[-1] == "MainThread"


def test_the_gate_goes_once_every_pending_part_is_done_even_without_a_launch(monkeypatch):
    """A launch costs one check again once the warm-up has compiled every bucket, whether or not any launch met one."""
    monkeypatch.setattr(launch_configs, "_bucket_gate", None)
    pending = model_warmup.PendingBuckets()
    gates = [threading.Event(), threading.Event()]
    warmup = KernelWarmup({"dit:8192": [gates[0].wait], "dit:16384": [gates[1].wait]}, torch.device("cpu"),
                          threads=2, on_part_done=pending.forget_done)  # fmt: skip
    pending.expect(warmup, {8192: "dit:8192", 16384: "dit:16384"})
    warmup.start()
    gates[0].set()
    assert warmup.finished("dit:8192").wait(5)
    assert set(pending._parts) == {16384} and launch_configs._bucket_gate is not None
    gates[1].set()
    warmup.wait()
    assert pending._parts == {} and launch_configs._bucket_gate is None


@pytest.fixture
def cancel_soon():
    """Cancel, as the user would, `delay` seconds from now through the host's interrupt flag (nodes/host.py); the
    flag is clear again after the test."""
    from qwen21_nodes.nodes import host

    timers = []

    def schedule(delay: float = 0.3):
        timer = threading.Timer(delay, host.request_interrupt)
        timers.append(timer)
        timer.start()
        return host

    yield schedule
    for timer in timers:
        timer.cancel()
    host._interrupt_requested.clear()


def test_a_wait_for_a_hung_compile_ends_when_the_user_cancels(cancel_soon):
    """A compile that never ends must not hold a run past Cancel (issue 43): the wait asks the host's interrupt check
    every WAIT_SLICE_S, raises its error, and leaves the warm-up as it was (the part still running, no waiter left)."""
    from qwen21_nodes.qwen21_core.startup.warmup import WAIT_SLICE_S

    hung = threading.Event()
    host = cancel_soon(0.3)
    warmup = KernelWarmup({"dit": [lambda: hung.wait(30)]}, torch.device("cpu"), threads=1,
                          check_interrupted=host.check_interrupted).start()  # fmt: skip
    started = time.perf_counter()
    with pytest.raises(host.Interrupted):
        warmup.wait("dit")
    assert time.perf_counter() - started < 0.3 + 10 * WAIT_SLICE_S
    assert not warmup.done("dit") and warmup._waiters == 0
    hung.set()
    warmup.wait()  # no interrupt pending: waits to the end
    assert warmup.done("dit") and not warmup.failures


def test_the_sampler_and_a_launch_of_a_compiling_bucket_stop_waiting_when_the_user_cancels(monkeypatch, cancel_soon):
    """The two waits of a run, as the pipeline starts the warm-up with the host's check: the sampler's for the DiT's
    first part, and a launch's for its bucket's part (the kernels' gate)."""
    hung = threading.Event()
    pipe = _pipeline_starting_a_warmup(monkeypatch, dit_jobs=[lambda: hung.wait(30)])
    host = cancel_soon(0.3)
    pipe.check_interrupted = host.check_interrupted
    warmup = pipe.start_kernel_warmup()
    try:
        with pytest.raises(host.Interrupted):
            model_warmup.before_sampling(warmup)
        monkeypatch.setattr(launch_configs, "_bucket_gate", None)
        pending = model_warmup.PendingBuckets()
        pending.expect(warmup, {8192: PART})  # a bucket whose part hangs
        kernel = launch_configs.TunedKernel("toy_cancel", ("M_BUCKET",), rule=lambda key: launch_configs.LaunchConfig
                                            .of(4), candidates=lambda key: [])  # fmt: skip
        monkeypatch.setattr(launch_configs, "architecture", lambda device: "sm_00")
        cancel_soon(0.3)
        with pytest.raises(host.Interrupted):
            kernel.launch(lambda *args: None, lambda config: (1,), (), {}, {"M_BUCKET": 8192}, torch.device("cpu"))
    finally:
        hung.set()
    warmup.wait()
    assert not warmup.failures


def test_a_failed_part_still_releases_the_launches_waiting_for_it():
    warmup = KernelWarmup({"dit:8192": [lambda: 1 / 0, lambda: None]}, torch.device("cpu"), threads=1).start()
    assert warmup.finished("dit:8192").wait(5)
    assert "dit:8192" in warmup.failures


@pytest.mark.slow
def test_vae_job_decodes_and_encodes_on_a_copy():
    torch.manual_seed(0)
    vae = QwenImage21VAE(TINY_VAE).eval()
    before = [p.clone() for p in vae.parameters()]
    for job in vae_warmup_jobs(vae, torch.device("cpu")):
        job()
    assert all(torch.equal(a, b) for a, b in zip(before, vae.parameters(), strict=True))


@contextlib.contextmanager
def triton_compiles():
    """The names of the Triton kernels compiled inside the block (the GPU work synchronised at both ends); skips
    where this Triton has no compile hook."""
    triton = pytest.importorskip("triton")
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hook to count compiles with")
    torch.cuda.synchronize()
    compiled = []
    runtime.jit_post_compile_hook = lambda **kwargs: compiled.append(getattr(kwargs.get("fn"), "__name__", "?"))
    try:
        yield compiled
        torch.cuda.synchronize()
    finally:
        runtime.jit_post_compile_hook = None


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int8_convrot", "bf16"])
def test_after_the_warmup_real_steps_of_new_sizes_compile_nothing(fmt):
    """The point of the warm-up: a prefill and decode of sizes and prompt lengths it never saw (rows and tokens are
    not specialised on; each bucket's configuration was compiled) launch only kernels that are already compiled."""
    from qwen21_nodes.qwen21_core.control import Control
    from qwen21_nodes.qwen21_core.dit.control import FunControlNet, control_plan
    from qwen21_nodes.qwen21_core.dit.sequence import build_layout
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    device = torch.device("cuda")
    torch.manual_seed(0)
    model = QwenImage21Transformer(TINY_TRANSFORMER).to(device, torch.bfloat16).eval()
    net = FunControlNet(TINY_TRANSFORMER, 1).to(device, torch.bfloat16).eval()  # a Fun-Control branch beside
    if fmt != "bf16":
        model = model.quantized_copy(uniform_plan(FORMATS[fmt], model.config.num_layers))
        net.quantize_linears(control_plan(FORMATS[fmt], 1))  # its skips too: their epilogue has a bias
    control = Control(net, 0.7, image=torch.zeros(1, 16, 16, 3))
    for jobs in dit_warmup_parts(model, device).values():
        for job in jobs:
            job()
    config = model.config
    with triton_compiles() as compiled, torch.inference_mode():
        for text, side in ((37, 6), (300, 20), (129, 34)):
            mask = torch.zeros(text, dtype=torch.bool)
            layout = build_layout(mask, [], (side, side))
            embeds = torch.randn(text, config.context_in_dim, device=device, dtype=torch.bfloat16)
            x = torch.randn(1, side * side, config.in_channels, device=device, dtype=torch.bfloat16)
            for with_control in (None, control):
                branch = model.new_branch(layout, 1, control=with_control)
                if with_control is not None:
                    branch.control.set_context(torch.randn(side * side, net.control_channels, device=device))
                model.prefill(branch, embeds, None)
                model.decode(branch, x, torch.full((1,), 0.5, device=device, dtype=torch.bfloat16))
                branch.release()
    assert compiled == []


@pytest.mark.gpu
def test_after_the_vae_warmup_decodes_and_encodes_of_real_sizes_compile_nothing():
    """The VAE's warm-up decodes small latents; a real image's decode and a reference's encode must then find every
    kernel variant compiled (Triton specialises integer arguments on divisibility by 16: the first 1024x1024 decode
    after a warm-up of 2x2 and 4x4 latents compiled the norm kernel's tail again, 0.4-0.5 s on a fresh machine)."""
    from qwen21_nodes.qwen21_core.config import VAEConfig

    device = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(device):
        vae = QwenImage21VAE(VAEConfig()).to(torch.bfloat16).eval()
    for job in vae_warmup_jobs(vae, device):
        job()
    with triton_compiles() as compiled, torch.inference_mode():
        for height, width in ((64, 64), (48, 84), (84, 48), (96, 96), (66, 66)):
            vae.decode(torch.randn(1, vae.config.z_dim, height, width, device=device, dtype=torch.bfloat16))
        vae.encode(torch.rand(1, 1024, 1024, 4, device=device))
    assert compiled == []


def test_torch_ops_only_counts_every_self_test_unproven_in_this_thread_only():
    from qwen21_nodes.kernels._triton import SelfTests, torch_ops_only

    tests, runs, seen_elsewhere = SelfTests("toy"), [], []
    check = ("check", torch.device("cpu"), torch.float32)

    def run():
        runs.append(1)
        return True

    with torch_ops_only():
        assert tests.passed(*check, run) is False and runs == []  # neither run nor remembered
        other = threading.Thread(target=lambda: seen_elsewhere.append(tests.passed(*check, run)))
        other.start()
        other.join()
    assert seen_elsewhere == [True] and runs == [1]
    assert tests.passed(*check, run) is True and runs == [1]


def _pipeline_with_vae_warmup(gate: threading.Event):
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline

    torch.manual_seed(0)
    pipe = Qwen21Pipeline.__new__(Qwen21Pipeline)  # only what decode touches
    pipe.vae = QwenImage21VAE(TINY_VAE).eval()
    pipe.last_decode_stats = {}
    pipe.kernel_warmup = KernelWarmup({"vae": [lambda: gate.wait(30)]}, torch.device("cpu"), threads=1).start()
    return pipe


def test_an_exact_decode_runs_torch_ops_instead_of_waiting_for_the_vae_warmup():
    """The exact decode's kernels equal torch's ops bit for bit, so while the warm-up still compiles them a decode
    uses torch's ops at once (the first image on a fresh H200 waited 9.3 s for them); afterwards it uses them."""
    gate = threading.Event()
    pipe = _pipeline_with_vae_warmup(gate)
    latents = torch.zeros(1, TINY_VAE.z_dim, 2, 2)
    started = time.perf_counter()
    during = pipe.decode(latents)
    assert time.perf_counter() - started < 10 and not pipe.kernel_warmup.done("vae")
    gate.set()
    pipe.kernel_warmup.wait()
    after = pipe.decode(latents)
    assert torch.equal(during, after)


def test_a_fast_decode_waits_for_the_vae_warmup():
    gate = threading.Event()
    pipe = _pipeline_with_vae_warmup(gate)
    finished = []
    worker = threading.Thread(target=lambda: finished.append(pipe.decode(torch.zeros(1, TINY_VAE.z_dim, 2, 2),
                                                                         quality="fast")))  # fmt: skip
    worker.start()
    worker.join(1.0)
    assert not finished  # still waiting for the warm-up
    gate.set()
    worker.join(60)
    assert finished and finished[0].shape[-1] == 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_the_gpu_torch_ops_decode_and_encode_the_same_bits_as_the_kernels(dtype):
    """What lets a decode skip the wait: the exact path with torch's ops gives the kernels' bits."""
    from qwen21_nodes.kernels._triton import torch_ops_only

    torch.manual_seed(0)
    vae = QwenImage21VAE(TINY_VAE).to("cuda", dtype).eval()
    z = torch.randn(1, TINY_VAE.z_dim, 5, 7, device="cuda")
    image = torch.rand(1, 64, 96, 4, device="cuda")
    with torch_ops_only():
        decoded, encoded = vae.decode(z, tiling="off"), vae.encode(image, tiling="off")
    assert torch.equal(vae.decode(z, tiling="off"), decoded)
    assert torch.equal(vae.encode(image, tiling="off"), encoded)


def _pipeline_starting_a_warmup(monkeypatch, encoder=None, dit_jobs=()):
    """A pipeline with only what start_kernel_warmup touches, on "cuda:0" (the warm-up starts on CUDA devices only),
    its warm-up's parts stubbed: the DiT's first part runs `dit_jobs`, the others have none, no CUDA stream."""
    from qwen21_nodes.qwen21_core import pipeline as pipeline_module
    from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
    from qwen21_nodes.qwen21_core.startup import model_warmup
    from qwen21_nodes.qwen21_core.startup import warmup as warmup_module

    pipe = pipeline_module.Qwen21Pipeline.__new__(pipeline_module.Qwen21Pipeline)
    pipe.kernel_warmup, pipe.text_encoder, pipe.transformer, pipe.vae = None, encoder, None, None
    pipe.execution_device = torch.device("cuda", 0)
    pipe.decode_graphs = DecodeGraphs(None)
    monkeypatch.setattr(model_warmup, "TRITON_AVAILABLE", True)
    monkeypatch.setattr(model_warmup, "dit_warmup_parts", lambda *args: {PART: list(dit_jobs)})
    monkeypatch.setattr(model_warmup, "later_buckets", lambda: ())
    monkeypatch.setattr("qwen21_nodes.qwen21_core.quant.kernel_warmup.dequantize_warmup_jobs", lambda *args: [])
    monkeypatch.setattr("qwen21_nodes.qwen21_core.vae.kernel_warmup.vae_warmup_jobs", lambda *args: [])
    monkeypatch.setattr(warmup_module, "side_stream", lambda device, purpose: None)
    return pipe


def test_the_pipeline_tells_its_decode_graphs_when_its_warmup_runs(monkeypatch):
    """The pipeline gives its decode graphs the warm-up's `busy` when it starts the warm-up: while the warm-up's threads
    may take the interpreter, a step's host share is read from the thread's CPU time (dit/decode_graphs.py)."""
    gate = threading.Event()
    pipe = _pipeline_starting_a_warmup(monkeypatch, dit_jobs=[lambda: gate.wait(30)])
    warmup = pipe.start_kernel_warmup()
    try:
        assert warmup is not None and pipe.decode_graphs.background_busy()
    finally:
        gate.set()
    warmup.wait()
    assert not warmup.failures and not pipe.decode_graphs.background_busy()


def test_the_image_encode_job_runs_a_tiny_model_and_leaves_shared_state_alone():
    """The job runs an image prompt through a tiny Qwen3-VL of the encoder's classes. It runs beside the main thread,
    so it must not touch what they share: the global random state, SDPA's backend flags (global in torch: a changed
    flag would change the kernel a decode step on the main thread picks) and the encoder itself."""
    from PIL import Image
    from qwen21_nodes.qwen21_core.text import kernel_warmup as text_warmup
    from qwen21_nodes.qwen21_core.text.encoder import ENCODE_INPUTS, Qwen21TextEncoder, build_prompt_text
    from qwen21_nodes.qwen21_core.text.tiny import build_tiny_text_encoder, tiny_text_encoder_config

    model, processor = build_tiny_text_encoder()
    encoder = Qwen21TextEncoder(model, processor)
    assert text_warmup.image_encode_warmup_jobs(encoder, torch.device("cpu")) == []  # off CUDA: nothing to load
    assert text_warmup.image_encode_warmup_jobs(None, torch.device("cuda", 0)) == []
    (job,) = text_warmup.image_encode_warmup_jobs(encoder, torch.device("cuda", 0))  # made, not run: no GPU here
    assert callable(job)

    image = Image.new("RGB", (text_warmup.WARMUP_IMAGE_SIZE,) * 2)
    inputs = processor(text=[build_prompt_text("a warm-up", 1)], images=[image], return_tensors="pt")
    inputs = {name: inputs[name] for name in ENCODE_INPUTS if name in inputs}
    assert "image_grid_thw" in inputs and inputs["pixel_values"].shape[0] > 0  # an image prompt indeed
    weights = {name: p.clone() for name, p in encoder.model.named_parameters()}
    rng = torch.random.get_rng_state()

    def flags():
        return (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled())  # fmt: skip

    before = flags()
    ran, seen_flags = [], set()
    original = torch.nn.Module.__call__

    def recording(module, *args, **kwargs):  # what ran, and SDPA's flags while it ran (a context restores them)
        ran.append(type(module).__name__)
        seen_flags.add(flags())
        return original(module, *args, **kwargs)

    sdpa_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.Module, "__call__", recording)
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                      lambda *args, **kwargs: sdpa_calls.append(1) or sdpa(*args, **kwargs))  # fmt: skip
        text_warmup.run_tiny_encode(tiny_text_encoder_config(processor.tokenizer), inputs, torch.device("cpu"),
                                    torch.bfloat16)  # fmt: skip
    assert "Qwen3VLVisionModel" in ran and "Qwen3VLTextModel" in ran  # the vision tower and the language model ran
    assert not sdpa_calls  # eager attention: no SDPA kernel chosen (and none planned) for the tiny model
    assert torch.equal(rng, torch.random.get_rng_state())
    assert seen_flags == {before} and flags() == before
    assert all(torch.equal(p, weights[name]) for name, p in encoder.model.named_parameters())


def test_an_image_encode_job_that_cannot_be_made_is_logged_and_left_out(caplog):
    """Making the job runs the processor on the loading thread, outside the warm-up's guard: a failure there must not
    fail the model's load."""
    from qwen21_nodes.qwen21_core.text.kernel_warmup import image_encode_warmup_jobs

    def broken(*args, **kwargs):
        raise ValueError("no image processor here")

    encoder = types.SimpleNamespace(processor=broken, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        assert image_encode_warmup_jobs(encoder, torch.device("cuda", 0)) == []
    assert "no image processor here" in caplog.text and "first edit" in caplog.text


def test_the_warmup_queues_the_image_encode_job_as_a_part_of_its_own(monkeypatch):
    """start_kernel_warmup queues the image-encode job, for the device the encoder runs on, as a part of its own
    (its failure must not skip the dequantisation jobs)."""
    asked, ran = [], []
    encoder = types.SimpleNamespace(model=None, device=torch.device("cuda", 1))
    pipe = _pipeline_starting_a_warmup(monkeypatch, encoder=encoder)
    monkeypatch.setattr("qwen21_nodes.qwen21_core.text.kernel_warmup.image_encode_warmup_jobs",
                        lambda enc, device: asked.append((enc, device)) or [lambda: ran.append(device)])  # fmt: skip
    warmup = pipe.start_kernel_warmup()
    warmup.wait()
    assert asked == [(encoder, torch.device("cuda", 1))] and ran == [torch.device("cuda", 1)]
    assert warmup.jobs["image_encode"] == 1 and warmup.jobs["text"] == 0 and not warmup.failures


@pytest.mark.gpu
def test_on_the_gpu_the_image_encode_job_runs_and_leaves_the_random_state_alone():
    """The job itself on CUDA: the meta-built tiny model given CUDA memory runs an image prompt, and neither the CPU's
    nor the GPU's random state moves (the main thread's seeds stay its own)."""
    from qwen21_nodes.qwen21_core.text.encoder import Qwen21TextEncoder
    from qwen21_nodes.qwen21_core.text.kernel_warmup import image_encode_warmup_jobs
    from qwen21_nodes.qwen21_core.text.tiny import build_tiny_text_encoder

    model, processor = build_tiny_text_encoder()
    (job,) = image_encode_warmup_jobs(Qwen21TextEncoder(model.to(torch.bfloat16), processor), torch.device("cuda", 0))
    cpu_rng, gpu_rng = torch.random.get_rng_state(), torch.cuda.get_rng_state()
    job()
    torch.cuda.synchronize()
    assert torch.equal(cpu_rng, torch.random.get_rng_state()) and torch.equal(gpu_rng, torch.cuda.get_rng_state())


def test_an_encode_pauses_a_running_warmup(monkeypatch):
    """The pipeline's encode holds the warm-up's pause: no job starts while the prompt is encoded."""
    import contextlib

    from qwen21_nodes.qwen21_core import pipeline as pipeline_module

    gate = threading.Event()
    pipe = pipeline_module.Qwen21Pipeline.__new__(pipeline_module.Qwen21Pipeline)  # only what encode touches
    pipe.kernel_warmup = KernelWarmup({"dit": [lambda: gate.wait(30)]}, torch.device("cpu"), threads=1).start()
    pipe.text_encoder, pipe.vae, pipe.references = None, None, None
    pipe._text_encoder_placed = contextlib.nullcontext
    pipe._prefix_budget = lambda: None
    seen = []
    monkeypatch.setattr(pipeline_module, "encode_conditioning",
                        lambda *args, **kwargs: seen.append(pipe.kernel_warmup._may_start.is_set()))  # fmt: skip
    pipe.encode("a prompt")
    assert seen == [False] and pipe.kernel_warmup._may_start.is_set()
    gate.set()
    pipe.kernel_warmup.wait()
    pipe.encode("the warm-up is done: nothing to pause")
    assert seen == [False, True]
