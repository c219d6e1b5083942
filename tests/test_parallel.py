"""Several devices, on the CPU: rank 0 (this process) and one worker process over gloo, both with the tiny DiT.

Sequence-parallel and CFG-parallel sampling give the single-process result (fp32 compute, <= 1e-5), each rank's
prefix K/V cache is half the single-process one, and a worker that fails is reported with its rank while the next
run works. The core tests run the DiT with fp8 block weights (dequantised to fp32 on the CPU), the node test with the
float weights read from the tiny checkpoint: both weight paths are covered with one worker start each.
"""

import os

import pytest
import torch
from qwen21_nodes.nodes import host
from qwen21_nodes.nodes.loader import Qwen21ModelLoader, worker_devices
from qwen21_nodes.nodes.lora import Qwen21LoraLoader
from qwen21_nodes.nodes.sample import Qwen21Sampler
from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER
from qwen21_nodes.qwen21_core.memory.manager import component_devices, own_gpu
from qwen21_nodes.qwen21_core.options import SampleOptions
from qwen21_nodes.qwen21_core.parallel.pool import ParallelError, WorkerPool
from qwen21_nodes.qwen21_core.parallel.recipes import FunctionRecipe, tiny_transformer
from qwen21_nodes.qwen21_core.parallel.ulysses import even_split
from qwen21_nodes.qwen21_core.sampler import Sampler, make_noise, parallel_mode
from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER
from qwen21_nodes.runner.cli import ensure_tiny_models

SEED = 3
Z = TINY_TRANSFORMER.in_channels
CONTEXT = TINY_TRANSFORMER.context_in_dim


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool.start(["cpu"], FunctionRecipe(tiny_transformer, (SEED,), {"weights": "fp8"}), "cpu",
                               timeout_s=60)  # fmt: skip
    yield workers
    workers.shutdown()


@pytest.fixture(scope="module")
def dit():
    return tiny_transformer("cpu", SEED, weights="fp8")


def _conditioning(content_hash="") -> Conditioning:
    """A prompt with one 4x4-latent condition image in its slots (an odd prefix: 5 text + 16 image rows) and a
    negative prompt, both with the image."""
    g = torch.Generator().manual_seed(5)

    def prompt(length, slot_start):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[slot_start : slot_start + 4] = True  # 4 slots = the 4x4 latent tokens of the image
        return PromptEmbedding(torch.randn(length, CONTEXT, generator=g), mask)

    image = torch.randn(Z, 4, 4, generator=g)
    return Conditioning(prompt(9, 2), prompt(7, 1), condition_latents=(image,), width=96, height=64,
                        content_hash=content_hash)  # fmt: skip


def _sample(dit, workers, parallel="auto", cfg=1.0, batch=1, **options):
    sampler = Sampler(dit, QWEN21_SCHEDULER, torch.zeros(Z), torch.ones(Z),
                      options=SampleOptions(parallel=parallel, **options), workers=workers)  # fmt: skip
    noise = make_noise(7, (batch, Z, 4, 6))
    latents = sampler.sample([_conditioning("same")], height=64, width=96, steps=3, true_cfg_scale=cfg, noise=noise,
                             batch_size=batch)  # fmt: skip
    return latents, sampler.stats


@pytest.mark.slow
@pytest.mark.parametrize("cfg, kv_cache", [(1.0, "bf16"), (4.0, "fp8")])
def test_sequence_parallel_equals_one_process_with_the_prefix_cache_sharded_by_heads(pool, dit, cfg, kv_cache):
    """kv_cache "bf16" is the compute dtype's cache (fp32 here); "fp8" a quantised one."""
    expected, single = _sample(dit, None, cfg=cfg, batch=2, kv_cache=kv_cache)
    got, stats = _sample(dit, pool, "sequence", cfg=cfg, batch=2, kv_cache=kv_cache)
    assert stats.kv_cache == ("float32" if kv_cache == "bf16" else kv_cache) + " on cpu"
    assert dit.quantization.startswith("fp8")
    assert (got - expected).abs().max().item() <= 1e-5
    assert stats.parallel == "sequence over 2 ranks" and "eagerly" in stats.decode_graph
    # 2 heads over 2 ranks: each rank holds exactly half of every cache buffer
    (worker,) = stats.ranks
    assert stats.cache_bytes * 2 == single.cache_bytes == worker["prefix_cache_bytes"] * 2
    if cfg == 1.0:  # a rerun of the same conditioning reuses every rank's kept prefix (no prefill), same result
        again, rerun = _sample(dit, pool, "sequence", cfg=cfg, batch=2, kv_cache=kv_cache)
        assert rerun.prefills == 0 and rerun.prefix_cache == "reused"
        assert torch.equal(again, got)


@pytest.mark.slow
def test_cfg_parallel_equals_one_process(pool, dit):
    expected, single = _sample(dit, None, cfg=4.0)
    got, stats = _sample(dit, pool, "cfg", cfg=4.0)
    assert (got - expected).abs().max().item() <= 1e-5
    assert stats.parallel == "cfg over 2 ranks" and stats.prefills == 2
    # rank 0 holds the positive branch's cache, rank 1 the negative one's
    assert 0 < stats.cache_bytes < single.cache_bytes == stats.cache_bytes + stats.ranks[0]["prefix_cache_bytes"]


@pytest.mark.slow
def test_a_failing_worker_is_reported_with_its_rank_and_the_next_run_works(pool, dit):
    expected, _ = _sample(dit, None)
    pool.inject_fault(1, "in_block", "error")  # mid-step, rank 0 waiting in an all-to-all
    with pytest.raises(ParallelError, match=r"rank 1 \(cpu\): RuntimeError: injected fault"):
        _sample(dit, pool, "sequence")
    assert (_sample(dit, pool, "sequence")[0] - expected).abs().max().item() <= 1e-5

    pool.inject_fault(1, "before_step", "oom")
    with pytest.raises(ParallelError, match="rank 1 .*out of memory.*Lower the output size"):
        _sample(dit, pool, "cfg", cfg=4.0)
    pool.inject_fault(1, "in_block", "exit")  # the worker process dies: it is restarted for the next run
    with pytest.raises(ParallelError, match="rank 1 .*process exited.*exit code 17"):
        _sample(dit, pool, "sequence")
    assert (_sample(dit, pool, "sequence")[0] - expected).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_the_watchdog_reports_any_error_and_keeps_watching(pool, dit, monkeypatch):
    """A worker's message that rank 0 cannot read (any exception, not only a closed channel) is a failure of that
    rank, reported to the caller; the watchdog thread goes on, and the worker is restarted for the next run."""
    from qwen21_nodes.qwen21_core.parallel import pool as pool_module

    expected, _ = _sample(dit, None)
    if pool.broken:
        pool._regroup()
    real_receive, garbled = pool_module.receive, []

    def receive_garbled(connection):
        message = real_receive(connection)
        if not garbled:
            garbled.append(message)
            raise ValueError("injected: an unreadable message")
        return message

    monkeypatch.setattr(pool_module, "receive", receive_garbled)
    with pytest.raises(ParallelError, match=r"rank 1 \(cpu\): .*injected: an unreadable message"):
        pool.release()
    assert pool._reader.is_alive() and garbled
    monkeypatch.undo()
    assert (_sample(dit, pool, "sequence")[0] - expected).abs().max().item() <= 1e-5


def test_parallel_mode_resolution_and_its_errors():
    class Two:
        world = 2

    assert parallel_mode("auto", None, True) is None and parallel_mode("off", Two, True) is None
    assert parallel_mode("auto", Two, True) == "cfg" and parallel_mode("auto", Two, False) == "sequence"
    with pytest.raises(ValueError, match="needs a model loaded on several GPUs"):
        parallel_mode("sequence", None, False)
    with pytest.raises(ValueError, match="needs true_cfg_scale > 1"):
        parallel_mode("cfg", Two, False)
    assert even_split(21, 2) == [11, 10] and even_split(1, 2) == [1, 0]


def test_loader_places_the_text_encoder_on_another_gpu_and_picks_the_worker_gpus(caplog):
    cuda = [torch.device("cuda", i) for i in range(4)]
    gib = 2**30
    assert component_devices(cuda[0], "auto", "auto", [24 * gib] * 2, 16 * gib) == (cuda[1], cuda[0])  # the 2nd GPU
    assert component_devices(cuda[1], "auto", "auto", [24 * gib] * 2, 16 * gib) == (cuda[0], cuda[1])
    assert component_devices(cuda[0], "auto", "auto", [24 * gib, 8 * gib, 24 * gib], 16 * gib)[0] == cuda[2]
    assert component_devices(cuda[0], "auto", "auto", [24 * gib, 8 * gib], 16 * gib)[0] == cuda[0]  # no room: stay
    assert component_devices(cuda[0], "auto", "cuda:1", [24 * gib]) == (cuda[0], cuda[1])  # one GPU: with the DiT
    assert component_devices(torch.device("cpu"), "auto", "auto", []) == (torch.device("cpu"),) * 2
    assert component_devices(cuda[0], "cuda:0", "auto", [24 * gib] * 4) == (cuda[0], cuda[0])
    assert worker_devices(cuda[1], 1, 4) == [] and worker_devices(cuda[1], 3, 4) == [cuda[0], cuda[2]]
    assert worker_devices(cuda[0], 0, 4) == cuda[1:]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert worker_devices(torch.device("cpu"), 2, 0) == [torch.device("cpu")]  # CPU ranks (tests), not silently:
    assert "gpus is 2 but the DiT runs on the CPU (0 CUDA GPU(s) here): starting 1 CPU worker" in caplog.text
    with pytest.raises(ValueError, match="gpus is 3 but this machine has 2 CUDA GPU"):
        worker_devices(cuda[0], 3, 2)


@pytest.mark.slow
def test_the_nodes_turn_it_on_with_the_loaders_gpus_and_the_samplers_parallel(tmp_path_factory):
    """Loader gpus=2 (on CPU: a second CPU process) starts a worker with the DiT read from the same file; the
    sampler's parallel input picks how a run uses it; the workers stop with the model."""
    from test_nodes import SAMPLER_DEFAULTS, encode

    models = ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models")
    host.set_models_dir(models)
    try:
        model, *_ = Qwen21ModelLoader().load(
            host.list_weight_files("diffusion_models")[0], host.list_weight_files("text_encoders")[0],
            host.list_weight_files("vae")[0], weight_dtype="auto", device="cpu", offload_text_encoder=True, gpus=2,
        )  # fmt: skip
        pool = model.pipe.workers
        assert pool.world == 2 and pool.workers[0].info["quantization"] == "float32"
        conditioning = encode(model)[0]
        (with_lora,) = Qwen21LoraLoader().load(model, host.list_weight_files("loras")[0], 0.8)
        latents = {}
        for handle in (model, with_lora):  # the workers merge the handle's LoRA as rank 0 does
            for parallel in ("off", "auto"):  # auto at true_cfg_scale 1 with 2 ranks: sequence
                inputs = {**SAMPLER_DEFAULTS, "steps": 2, "parallel": parallel}
                out = Qwen21Sampler().sample(handle, conditioning, **inputs)
                latents[handle is model, parallel] = out["result"][0]["samples"]
                assert ("sequence over 2 ranks" in out["ui"]["qwen21_status"][0]) == (parallel != "off")
            assert (latents[handle is model, "auto"] - latents[handle is model, "off"]).abs().max().item() <= 1e-5
        assert (latents[True, "off"] - latents[False, "off"]).abs().max().item() > 1e-2  # the LoRA changed the image
        model.pipe.stop_workers()
        assert pool.closed and model.pipe.workers is None
    finally:
        host.set_models_dir(None)


@pytest.mark.gpu
def test_two_gpus_over_nccl_match_one_gpu_and_recover_from_a_worker_fault():
    """On a machine with 2 GPUs (the x2 H200): the same checks over NCCL, with CUDA graphs in CFG mode and the
    watchdog's abort ending rank 0's wait when the worker fails mid-step. fp32 (no TF32), so within 1e-4."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (run on nvidia-h200-x2)")
    from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs

    dit = tiny_transformer("cuda:0", SEED)
    graphs = DecodeGraphs(dit, launch_bound_share=0)
    workers = WorkerPool.start(["cuda:1"], FunctionRecipe(tiny_transformer, (SEED,)), "cuda:0", timeout_s=60)
    try:
        assert workers.backend == "nccl"

        def run(parallel, cfg):
            options = SampleOptions(parallel=parallel)
            sampler = Sampler(dit, QWEN21_SCHEDULER, torch.zeros(Z), torch.ones(Z), options=options,
                              decode_runner=graphs, workers=workers)  # fmt: skip
            latents = sampler.sample([_conditioning()], height=64, width=96, steps=3, true_cfg_scale=cfg,
                                     noise=make_noise(7, (1, Z, 4, 6)))  # fmt: skip
            return latents.cpu(), sampler.stats

        for parallel, cfg in (("sequence", 1.0), ("cfg", 4.0), ("sequence", 4.0)):
            expected, _ = run("off", cfg)
            got, stats = run(parallel, cfg)
            assert (got - expected).abs().max().item() <= 1e-4, (parallel, cfg)
            if parallel == "cfg":  # rank 1 captured its negative branch's steps and replayed them
                assert stats.ranks[0]["decode_graph"].startswith("replay"), stats.ranks
        workers.inject_fault(1, "in_block", "error")
        with pytest.raises(ParallelError, match=r"rank 1 \(cuda:1\): RuntimeError: injected fault"):
            run("sequence", 1.0)
        assert (run("sequence", 1.0)[0] - run("off", 1.0)[0]).abs().max().item() <= 1e-4
    finally:
        workers.shutdown()


@pytest.mark.gpu
def test_text_encoder_on_the_second_gpu_stays_there_and_its_conditioning_reaches_the_dit(tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (run on nvidia-h200-x2)")
    from test_nodes import SAMPLER_DEFAULTS, encode

    host.set_models_dir(ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models"))
    try:
        files = [host.list_weight_files(kind)[0] for kind in ("diffusion_models", "text_encoders", "vae")]
        model, *_ = Qwen21ModelLoader().load(*files, weight_dtype="bf16", device="cuda:0", offload_text_encoder=True)
        pipe = model.pipe
        assert pipe.text_encoder_device == torch.device("cuda", 1) and pipe.vae_execution_device.index == 0
        assert own_gpu(pipe.text_encoder_device, model.device) and not pipe.text_encoder_offload
        conditioning = encode(model)[0]
        assert conditioning.positive.embeds.device == torch.device("cuda", 1)
        assert next(pipe.text_encoder.model.parameters()).device == torch.device("cuda", 1)  # not offloaded
        out = Qwen21Sampler().sample(model, conditioning, **{**SAMPLER_DEFAULTS, "steps": 2})
        assert torch.isfinite(out["result"][0]["samples"]).all()
    finally:
        host.set_models_dir(None)


def _call(module: str, name: str, *args) -> bytes:
    """Pickle opcodes that make an unpickler call module.name(*args) (GLOBAL; under protocol 4 a dotted name is
    followed attribute by attribute). args: str, bytes, or another _call."""
    out = b"c" + module.encode() + b"\n" + name.encode() + b"\n" + b"("
    for arg in args:
        if isinstance(arg, str):
            out += b"X" + len(arg.encode()).to_bytes(4, "little") + arg.encode()
        elif isinstance(arg, bytes) and arg.startswith(b"c"):
            out += arg  # a nested call
        else:
            out += b"B" + len(arg).to_bytes(4, "little") + arg
    return out + b"tR"


def _pickle_gadgets(marker) -> dict[str, bytes]:
    """The review's gadgets against a channel that unpickled with a module-prefix allowlist, each creating `marker`."""
    import io
    import os

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    saved = io.BytesIO()
    torch.save(Exploit(), saved)  # what torch.load(weights_only=False) would run
    touch, pool = f"touch {marker}", "qwen21_nodes.qwen21_core.parallel.pool"
    gadgets = {
        "torch + os.system": _call("torch", "os.system", touch),
        "pathlib + os.system": _call("pathlib", "os.system", touch),
        "the pool's subprocess.getoutput": _call(pool, "subprocess.getoutput", touch),
        "Path.write_text": _call("pathlib", "Path.write_text", _call("pathlib", "Path", str(marker)), "owned"),
        "torch.storage._load_from_bytes": _call("torch.storage", "_load_from_bytes", saved.getvalue()),
    }
    return {what: b"\x80\x04" + body + b"." for what, body in gadgets.items()}


@pytest.mark.parametrize("gadget", ["torch + os.system", "pathlib + os.system", "the pool's subprocess.getoutput",
                                    "Path.write_text", "torch.storage._load_from_bytes"])  # fmt: skip
def test_the_command_channel_refuses_pickle_gadgets(tmp_path, gadget):
    """A message read back never runs what it names: every gadget that got through the old unpickler is refused
    with an error, and nothing it would have done happens."""
    from multiprocessing import Pipe

    from qwen21_nodes.qwen21_core.parallel.channel import receive

    marker = tmp_path / "owned"
    ours, theirs = Pipe()
    ours.send_bytes(_pickle_gadgets(marker)[gadget])
    with pytest.raises(Exception, match="unknown tag|refuses"):
        receive(theirs)
    assert not marker.exists()


def test_the_command_channel_carries_no_pickle():
    """A tensor pickled the plain way (which unpickles through torch.load) is refused too: the channel has a format
    of its own, and what it names must be in its exact allowlist."""
    import pickle
    from multiprocessing import Pipe

    from qwen21_nodes.qwen21_core.parallel import wire
    from qwen21_nodes.qwen21_core.parallel.channel import receive

    ours, theirs = Pipe()
    ours.send_bytes(pickle.dumps(("job", torch.arange(3))))
    with pytest.raises(wire.MessageError, match="unknown tag"):
        receive(theirs)

    def reference(tag: bytes, module: str, name: str) -> bytes:
        out = bytearray(tag)
        wire._write_text(out, b"s", module)
        wire._write_text(out, b"s", name)
        return bytes(out) + (b"d" + wire._COUNT.pack(0) if tag == b"o" else b"")

    recipes = "qwen21_nodes.qwen21_core.parallel.recipes"
    named = [
        (b"g", "posix", "system"),
        (b"g", "torch", "os.system"),
        (b"g", "pathlib", "os.system"),
        (b"g", "qwen21_nodes.qwen21_core.parallel.pool", "subprocess.getoutput"),
        (b"g", "qwen21_nodes.qwen21_core.parallel.pool", "worker_python_path"),  # the pack's, but not a builder
        (b"g", "torch.storage", "_load_from_bytes"),
        (b"g", recipes, "tiny_transformer.__globals__"),
        (b"o", "pathlib", "Path"),
        (b"o", "collections", "OrderedDict"),
        (b"o", "torch", "Tensor"),
    ]
    for tag, module, name in named:
        kind = b"s" + wire._COUNT.pack(3) + b"job"
        ours.send_bytes(b"t" + wire._COUNT.pack(2) + kind + reference(tag, module, name))
        with pytest.raises(wire.MessageError, match=f"refuses (function|class) {module}.{name}"):
            receive(theirs)


def _test_builder(device):
    """A test's own DiT builder (what a FunctionRecipe names)."""
    return tiny_transformer(device, SEED)


def test_the_command_channel_round_trips_the_pack_s_messages(monkeypatch):
    """What the pack sends comes back equal: containers, tensors of every dtype (bytes and shapes), dtypes, devices,
    its message classes; a test's own DiT builder travels only when rank 0 lists it exactly (module:name)."""
    from multiprocessing import Pipe

    from qwen21_nodes.qwen21_core.dit.kv_cache import KVCacheSpec
    from qwen21_nodes.qwen21_core.options import SampleOptions
    from qwen21_nodes.qwen21_core.parallel import wire
    from qwen21_nodes.qwen21_core.parallel.channel import (
        TRUSTED_FUNCTIONS_ENV,
        Failure,
        receive,
        send,
        trust_functions,
        trusted_functions,
    )
    from qwen21_nodes.qwen21_core.parallel.jobs import BranchInput, JobSpec
    from qwen21_nodes.qwen21_core.parallel.recipes import FileRecipe, FunctionRecipe, tiny_transformer
    from qwen21_nodes.qwen21_core.quant.plan import WeightFormats

    ours, theirs = Pipe()
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 5, generator=g).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16,
               torch.float8_e4m3fn)] + [torch.arange(6).reshape(2, 3), torch.tensor([True, False]),
               torch.zeros(0, 4), torch.tensor(2.5), torch.randn(4, 4, generator=g).t()]  # fmt: skip
    branch = BranchInput("positive", torch.randn(9, 8, generator=g), torch.ones(9, dtype=torch.bool),
                         ("hash", "positive", "torch.float32", None))  # fmt: skip
    spec = JobSpec("sequence", [branch], [(4, 4)], None, (2, 3), 1, SampleOptions(kv_cache="fp8", kv_placement="cpu"),
                   loras=(("/x.safetensors", "id", 0.5),))  # fmt: skip
    failure = Failure(1, "cpu", "out of memory", "CUDA out of memory")
    recipe = FileRecipe("/models/dit.safetensors", torch.bfloat16, WeightFormats("fp8", keep=("img_mlp.out",)))
    payload = {"tensors": tensors, "dtype": torch.bfloat16, "device": torch.device("cuda", 1), "big": 2**70,
               "neg": -(2**63), "floats": (float("inf"), -0.0), "bytes": b"\x00\xff", ("a", 1): None,
               "size": torch.Size([2, 3])}  # fmt: skip
    send(ours, "job", payload, spec, failure, recipe, FunctionRecipe(tiny_transformer, (3,), {"weights": "fp8"}))
    kind, back, spec_back, failure_back, recipe_back, builder = receive(theirs)
    assert kind == "job" and failure_back == failure and recipe_back == recipe
    for sent, got in zip(tensors, back["tensors"], strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))  # bit for bit
    assert back["dtype"] is torch.bfloat16 and back["device"] == torch.device("cuda", 1)
    assert back["big"] == 2**70 and back["neg"] == -(2**63) and back["floats"] == (float("inf"), -0.0)
    assert back["bytes"] == b"\x00\xff" and back[("a", 1)] is None and back["size"] == (2, 3)
    assert spec_back.kv == KVCacheSpec("fp8", "cpu") and spec_back.loras == spec.loras
    assert torch.equal(spec_back.branches[0].embeds, spec.branches[0].embeds)
    assert spec_back.branches[0].prefix_id == spec.branches[0].prefix_id
    assert builder.function is tiny_transformer and builder.args == (3,) and builder.kwargs == {"weights": "fp8"}

    assert trusted_functions(FunctionRecipe(tiny_transformer)) == ""  # the pack's own builder needs no listing
    assert trusted_functions(FunctionRecipe(_test_builder)) == f"{__name__}:_test_builder"
    send(ours, "load", FunctionRecipe(_test_builder))
    with pytest.raises(wire.MessageError, match=f"refuses function {__name__}._test_builder"):
        receive(theirs)
    trust_functions(trusted_functions(FunctionRecipe(_test_builder)))  # what a worker's start does with the env
    send(ours, "load", FunctionRecipe(_test_builder))
    assert receive(theirs)[1].function is _test_builder
    with pytest.raises(ValueError, match=f"{TRUSTED_FUNCTIONS_ENV}: .* is not module:function_name"):
        trust_functions(f"{__name__}:_test_builder.__globals__")
    trust_functions("")
    for bad in (object(), {1, 2}, lambda: 0):
        with pytest.raises(wire.MessageError):
            send(ours, "job", bad)


def _listening_addresses(port: int) -> list[str]:
    """The local addresses of the sockets listening on `port` (Linux: /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


def _other_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback (none on a machine without a network)."""
    import socket

    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return sorted({info[4][0] for info in infos if not info[4][0].startswith("127.")})


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads the listening sockets from Linux's /proc")
def test_the_rendezvous_store_listens_on_loopback_only():
    """Rank 0's store holds the group's keys unauthenticated: only this machine's own processes may reach it."""
    import datetime
    import socket

    import torch.distributed as dist
    from qwen21_nodes.qwen21_core.parallel import group

    store = group.host_store(10.0)
    try:
        assert _listening_addresses(store.port) == ["0100007F"]  # 127.0.0.1, and no wildcard (0.0.0.0 or ::)
        for address in _other_addresses():
            with pytest.raises(OSError), socket.create_connection((address, store.port), timeout=2):
                pass
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("qwen21-test", "ok")
        assert store.get("qwen21-test") == b"ok"
    finally:
        del store


@pytest.mark.slow
def test_a_silent_local_connection_does_not_stall_the_start(monkeypatch):
    """Before the workers connect, local processes connect to the channel and say nothing (three of them), another
    sends garbage: each is dropped after the handshake timeout, on a thread of its own, and the workers are taken as
    they come (one at a time, two silent ones outlasted a worker's own handshake and the start failed)."""
    import socket
    import time

    real_spawn, rogues = WorkerPool._spawn, []

    def spawn_after_rogues(self, workers):
        address = self._listener.getsockname()
        rogues.extend(socket.create_connection(address) for _ in range(3))  # connect and stay silent
        noisy = socket.create_connection(address)
        noisy.sendall(b"\xff" * 64)
        rogues.append(noisy)
        real_spawn(self, workers)

    monkeypatch.setattr(WorkerPool, "_spawn", spawn_after_rogues)
    started = time.perf_counter()
    workers = WorkerPool.start(["cpu"], FunctionRecipe(tiny_transformer, (SEED,)), "cpu", timeout_s=60,
                               load_timeout_s=90)  # fmt: skip
    try:
        assert time.perf_counter() - started < 75
        assert workers.workers[0].info["device"] == "cpu"
    finally:
        workers.shutdown()
        for rogue in rogues:
            rogue.close()


def test_a_crafted_tensor_in_a_message_is_a_message_error():
    """A quantised dtype (no plain bytes) and a dimension beyond torch's sizes are refused by name: they once ended
    the worker's listener thread with a raw RuntimeError."""
    from qwen21_nodes.qwen21_core.parallel import wire

    allowed = wire.Allowed({}, {})

    def tensor_message(dtype: str, shape: tuple) -> bytes:
        out = bytearray(b"X")
        wire._write_text(out, b"s", dtype)
        wire._write(out, shape, allowed, 1)
        return bytes(out + b"b" + wire._COUNT.pack(0))

    assert wire.decode(tensor_message("int8", (0, 3)), allowed).shape == (0, 3)
    with pytest.raises(wire.MessageError, match="unknown dtype 'qint8'"):
        wire.decode(tensor_message("qint8", (0,)), allowed)
    with pytest.raises(wire.MessageError, match="sizes >= 0"):
        wire.decode(tensor_message("int8", (0, 2**200)), allowed)


@pytest.mark.skipif(not os.path.exists("/sys/class/net/lo"), reason="names Linux's loopback interface, lo")
def test_gloo_and_nccl_sockets_are_kept_on_the_loopback_interface(monkeypatch):
    """Every rank is on this host: the groups' own sockets listen on the loopback interface only, in the workers'
    environment and in rank 0's while its group forms; rank 0's environment is as it was afterwards."""
    from qwen21_nodes.qwen21_core.parallel import group

    assert group.loopback_sockets() == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")
    with group._group_environment("gloo"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo" and os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in os.environ and os.environ["NCCL_SOCKET_IFNAME"] == "eth7"
