"""Decode graphs on the CPU with a stand-in capture that has CUDA-graph semantics (fake_cuda_graph.py: the
recorded ops replay on the recorded tensors; Python code and rebound tensors are not seen), so replay-vs-eager
checks here can fail the way they would on the GPU; plus real CUDA-graph replay against eager decode on the GPU.
Covered: keys, ownership, adoption (also of a layout whose rotary tables differ under the same key), eviction,
failures and the cache-allocation out-of-memory retry."""

import pytest
import torch
from dit_reference import CHANNELS, CONTEXT, our_dit, prompt_mask, reference_dit
from fake_cuda_graph import RecordingCapture
from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.sampler import Sampler

pytest.importorskip("diffusers")


Recorder = RecordingCapture


@pytest.fixture(scope="module")
def model():
    return our_dit(reference_dit())


def _layout(text=5, target=(4, 4), shapes=((4, 4),)):
    return build_layout(prompt_mask(text, list(shapes)), list(shapes), target)


def _prefill(model, branch, layout, seed):
    """Prefill `branch` with the prompt and one 4x4 condition image drawn from `seed`."""
    g = torch.Generator().manual_seed(seed)
    tokens = 4 * 4
    model.prefill(branch, torch.randn(layout.prefix_len - 3 * 4, CONTEXT, generator=g),
                  torch.randn(tokens, CHANNELS, generator=g))  # fmt: skip
    return branch


def _prefilled(graphs, layout, role="positive", seed=0):
    return _prefill(graphs.transformer, graphs.new_branch(layout, 1, "auto", role), layout, seed)


def test_capture_once_then_replay_equals_eager(model):
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    layout = _layout()
    branch = _prefilled(graphs, layout)
    x = torch.randn(1, 16, CHANNELS)
    for t in (0.9, 0.5, 0.2):
        tt = torch.full((1,), t)
        assert torch.equal(graphs(branch, x * t, tt), model.decode(branch, x * t, tt))
    assert recorder.captures == 1
    assert graphs.describe() == "replay"


def test_second_live_branch_with_the_same_key_decodes_eagerly(model):
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    layout = _layout()
    first, second = _prefilled(graphs, layout), _prefilled(graphs, layout, seed=1)
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    graphs(first, x, t)
    assert torch.equal(graphs(second, x, t), model.decode(second, x, t))
    assert recorder.captures == 1
    assert "another live generation" in graphs.describe()


def test_next_generation_adopts_the_idle_entry_without_recapture(model):
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    layout = _layout()
    first = _prefilled(graphs, layout)
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    graphs(first, x, t)
    cache = first.cache
    graphs.release(first)
    assert cache.allocated  # the entry keeps its buffers
    second = _prefilled(graphs, layout, seed=7)
    assert second is first and second.cache is cache
    fresh = _prefill(model, model.new_branch(layout), layout, seed=7)
    assert torch.equal(graphs(second, x, t), model.decode(fresh, x, t))
    assert recorder.captures == 1


def test_idle_entries_report_the_cache_bytes_a_new_generation_gets_back(model):
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=Recorder())
    branch = _prefilled(graphs, _layout())
    graphs(branch, torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5))
    assert graphs.idle_cache_bytes() == 0  # in use: not free for anyone else
    graphs.release(branch)
    assert graphs.idle_cache_bytes() == branch.cache.nbytes > 0
    graphs.clear()
    assert graphs.idle_cache_bytes() == 0


def test_idle_entries_also_give_back_their_graphs_private_pools(model, monkeypatch):
    """The free estimate leaves CUDA-graph pools out (only their graph can use them), so the idle entries count
    them back: a rerun adopts the entry, pool and all; a different job evicts it."""
    from qwen21_nodes.qwen21_core.dit import decode_graphs

    graphs = DecodeGraphs(model, launch_bound_share=0, capture=Recorder())
    branch = _prefilled(graphs, _layout())
    graphs(branch, torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5))
    (entry,) = graphs.entries.values()
    entry.graph.pool = lambda: (7, 1)
    monkeypatch.setattr(decode_graphs, "graph_pool_idle_bytes", lambda device: {(7, 1): 3000, (8, 1): 5})
    assert graphs.idle_cache_bytes() == 0
    graphs.release(branch)
    assert graphs.idle_cache_bytes() == branch.cache.nbytes + 3000


def test_the_stand_in_capture_replays_the_recorded_tensors_not_the_python_code(model):
    """What makes the replay checks here able to fail: a tensor rebound after capture is seen by eager decode
    but not by a replay (as on the GPU), and a replay after the rebinding is undone gives the captured result."""
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    branch = _prefilled(graphs, _layout())
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    captured = graphs(branch, x, t)
    assert recorder.graphs[0].ops and recorder.graphs[0].replays == 1  # the first step already replays
    kept = branch.target_cos
    branch.target_cos = kept.flip(0).contiguous()  # other values in a new tensor
    try:
        assert not torch.equal(graphs(branch, x, t), model.decode(branch, x, t))
    finally:
        branch.target_cos = kept
    assert torch.equal(graphs(branch, x, t), captured) and recorder.graphs[0].replays == 3


def test_adopting_an_entry_refreshes_rotary_tables_that_differ_under_the_same_key(model):
    """A 4x4 and a 2x8 condition image have the same token count, so the same key, but the target sits at
    another rotary frame position (the frame advances by max(h, w)): adoption must copy the new tables into
    the captured buffers in place."""
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    square, wide = _layout(shapes=((4, 4),)), _layout(shapes=((2, 8),))
    assert graphs.key_for(square, 1, "auto", "positive") == graphs.key_for(wide, 1, "auto", "positive")
    assert not torch.equal(model.new_branch_tables(square).target_cos, model.new_branch_tables(wide).target_cos)
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    first = _prefilled(graphs, square)
    graphs(first, x, t)
    graphs.release(first)
    second = _prefilled(graphs, wide, seed=7)
    assert second is first  # adopted
    fresh = _prefill(model, model.new_branch(wide), wide, seed=7)
    assert torch.equal(graphs(second, x, t), model.decode(fresh, x, t))
    assert recorder.captures == 1


def test_cache_allocation_out_of_memory_evicts_idle_entries_and_retries(model, monkeypatch):
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=Recorder())
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    idle = _prefilled(graphs, _layout(text=5))
    graphs(idle, x, t)
    graphs.release(idle)
    busy = _prefilled(graphs, _layout(text=6))
    graphs(busy, x, t)  # in use by a live generation: never evicted
    released = []
    original_release = idle.release
    monkeypatch.setattr(idle, "release", lambda: released.append("idle") or original_release())
    original_new_branch = model.new_branch
    entries_seen = []

    def out_of_memory_once(*args, **kwargs):
        entries_seen.append(len(graphs.entries))
        if len(entries_seen) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original_new_branch(*args, **kwargs)

    monkeypatch.setattr(model, "new_branch", out_of_memory_once)
    layout = _layout(text=7)
    branch = graphs.new_branch(layout, 1, "auto", "positive")
    assert entries_seen == [2, 1]  # retried once, after the idle entry was evicted
    assert released == ["idle"] and list(graphs.entries) == [busy.graph_key]
    assert branch.graph_key == graphs.key_for(layout, 1, "auto", "positive") and branch.cache is not None

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(model, "new_branch", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        graphs.new_branch(_layout(text=8), 1, "auto", "positive")  # nothing idle left: the error reaches the caller
    assert list(graphs.entries) == [busy.graph_key]


def test_lru_eviction_frees_the_old_entry_before_capturing(model):
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, max_entries=1, capture=recorder)
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    first = _prefilled(graphs, _layout(text=5))
    graphs(first, x, t)
    graphs.release(first)
    second = _prefilled(graphs, _layout(text=7))
    graphs(second, x, t)
    assert recorder.captures == 2
    assert len(graphs.entries) == 1
    assert not first.cache.allocated  # evicted: its buffers were released


def test_all_slots_busy_falls_back_to_eager(model):
    graphs = DecodeGraphs(model, launch_bound_share=0, max_entries=1, capture=Recorder())
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    a = _prefilled(graphs, _layout(text=5))
    graphs(a, x, t)
    b = _prefilled(graphs, _layout(text=6))
    assert torch.equal(graphs(b, x, t), model.decode(b, x, t))
    assert "all 1 graph slots are in use" in graphs.describe()


@pytest.mark.parametrize(
    "error, words",
    [(torch.OutOfMemoryError("CUDA out of memory"), "out of memory"), (RuntimeError("capture broke"), "RuntimeError")],
)
def test_capture_failure_is_remembered_and_decodes_eagerly(model, error, words):
    recorder = Recorder(fail=error)
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    layout = _layout()
    branch = _prefilled(graphs, layout)
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    assert torch.equal(graphs(branch, x, t), model.decode(branch, x, t))
    graphs(branch, x, t)
    assert recorder.captures == 1  # not retried
    assert words in graphs.describe()
    assert branch.cache.allocated  # the generation's own cache is intact


def test_moved_weights_invalidate_all_entries(model, monkeypatch):
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=Recorder())
    layout = _layout()
    branch = _prefilled(graphs, layout)
    graphs(branch, torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5))
    graphs.release(branch)
    from qwen21_nodes.qwen21_core.dit import decode_graphs

    monkeypatch.setattr(decode_graphs, "weights_signature", lambda transformer: ("moved",))
    _prefilled(graphs, layout)
    assert not graphs.entries
    assert "weights moved" in graphs.describe()


def test_no_capture_is_tried_under_the_async_allocator_unless_every_launch_is_direct(model, monkeypatch):
    """ComfyUI turns on cudaMallocAsync by default; a capture there fails inside Triton's own launch path and the
    failed capture's memory aborts the process when freed (seen in a real ComfyUI on the H200), so no capture may
    even start unless every Triton launch takes the direct path (kernels/launch.py), which does not check pointers."""
    from qwen21_nodes.qwen21_core.dit import decode_graphs

    monkeypatch.setattr(decode_graphs, "cuda_allocator_backend", lambda: "cudaMallocAsync")
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    monkeypatch.setattr(decode_graphs, "direct_launches", lambda: False)
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    branch = _prefilled(graphs, _layout())
    assert torch.equal(graphs(branch, x, t), model.decode(branch, x, t))
    assert recorder.captures == 0
    assert "cudaMallocAsync" in graphs.describe() and "--disable-cuda-malloc" in graphs.describe()
    assert "Triton's own launch path" in graphs.describe()

    monkeypatch.setattr(decode_graphs, "direct_launches", lambda: True)
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    branch = _prefilled(graphs, _layout())
    for _ in range(3):
        graphs(branch, x, t)
    assert recorder.captures == 1

    monkeypatch.setattr(model, "streaming_signature", lambda: (3, 4))
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    branch = _prefilled(graphs, _layout())
    graphs(branch, x, t)
    assert recorder.captures == 0 and "stream" in graphs.describe()
    monkeypatch.setattr(model, "streaming_signature", lambda: ())  # resident again

    monkeypatch.setattr(type(model), "compiled", property(lambda self: True))
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    branch = _prefilled(graphs, _layout())
    graphs(branch, x, t)
    assert recorder.captures == 0 and "compiled" in graphs.describe()


def test_default_capture_needs_cuda(model):
    graphs = DecodeGraphs(model, launch_bound_share=0)
    branch = _prefilled(graphs, _layout())
    x, t = torch.randn(1, 16, CHANNELS), torch.full((1,), 0.5)
    assert torch.equal(graphs(branch, x, t), model.decode(branch, x, t))
    assert "not on CUDA" in graphs.describe()


def test_sampler_with_graphs_equals_eager(model):
    mean, std = torch.zeros(CHANNELS), torch.ones(CHANNELS)
    g = torch.Generator().manual_seed(3)
    cond = Conditioning(
        PromptEmbedding(torch.randn(9, CONTEXT, generator=g), torch.zeros(9, dtype=torch.bool)),
        PromptEmbedding(torch.randn(6, CONTEXT, generator=g), torch.zeros(6, dtype=torch.bool)),
    )
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    kw = dict(height=64, width=64, steps=4, true_cfg_scale=3.0, seed=1)
    eager = Sampler(model, QWEN21_SCHEDULER, mean, std).sample([cond], **kw)
    for _ in range(2):  # the second run adopts the entries
        graphed = Sampler(model, QWEN21_SCHEDULER, mean, std, decode_runner=graphs).sample([cond], **kw)
        graphs.end_generation()
        assert torch.equal(graphed, eager)
    assert recorder.captures == 2  # one per CFG branch, reused by the second run


@pytest.mark.gpu
def test_cuda_graph_replay_is_bit_identical_to_eager():
    torch.manual_seed(0)
    model = our_dit(reference_dit()).to("cuda", torch.bfloat16)
    graphs = DecodeGraphs(model, launch_bound_share=0)
    layout = _layout()
    branch = graphs.new_branch(layout, 1, "auto", "positive")
    model.prefill(
        branch, torch.randn(layout.prefix_len - 12, CONTEXT, device="cuda"), torch.randn(16, CHANNELS, device="cuda")
    )
    x = torch.randn(1, 16, CHANNELS, device="cuda", dtype=torch.bfloat16)
    for t in (0.9, 0.4):
        tt = torch.full((1,), t, device="cuda", dtype=torch.bfloat16)
        assert torch.equal(graphs(branch, x * t, tt), model.decode(branch, x * t, tt))
    assert graphs.describe() == "replay"


@pytest.mark.gpu
def test_captures_leave_no_memory_behind_on_the_gpu():
    """Capture after capture, nothing stays allocated once the graphs are gone (a new warm-up stream per capture
    left a cuBLAS workspace behind each time)."""
    from qwen21_nodes.qwen21_core.dit.decode_graphs import cuda_graph_capture

    weight = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)

    def capture_once():
        x, t = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16), torch.ones(1, device="cuda")
        graph, out = cuda_graph_capture(lambda x, t: (x @ weight) * t, x, t)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, (x @ weight) * t)
        del graph, out
        torch.cuda.empty_cache()

    capture_once()
    before = torch.cuda.memory_allocated()
    for _ in range(3):
        capture_once()
    assert torch.cuda.memory_allocated() - before < 2**20


def test_rerun_of_the_same_conditioning_reuses_the_kept_prefix(model):
    mean, std = torch.zeros(CHANNELS), torch.ones(CHANNELS)
    g = torch.Generator().manual_seed(4)
    prompt = PromptEmbedding(torch.randn(9, CONTEXT, generator=g), torch.zeros(9, dtype=torch.bool))
    cond = Conditioning(prompt, content_hash="abc")
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=Recorder())
    kw = dict(height=64, width=64, steps=3)
    first = Sampler(model, QWEN21_SCHEDULER, mean, std, decode_runner=graphs)
    first.sample([cond], seed=1, **kw)
    graphs.end_generation()
    assert first.stats.prefills == 1
    second = Sampler(model, QWEN21_SCHEDULER, mean, std, decode_runner=graphs)
    out = second.sample([cond], seed=2, **kw)
    graphs.end_generation()
    assert second.stats.prefills == 0 and second.stats.prefix_cache == "reused"
    assert torch.equal(out, Sampler(model, QWEN21_SCHEDULER, mean, std).sample([cond], seed=2, **kw))
    # a different conditioning with the same shapes must not reuse it
    other = Conditioning(PromptEmbedding(prompt.embeds + 1, prompt.image_pad_mask), content_hash="xyz")
    third = Sampler(model, QWEN21_SCHEDULER, mean, std, decode_runner=graphs)
    third.sample([other], seed=2, **kw)
    assert third.stats.prefills == 1


def test_compiled_and_eager_blocks_never_share_a_graph(model):
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=Recorder())
    layout = _layout()
    eager_key = graphs.key_for(layout, 1, "auto", "positive")
    model.compile_blocks(True)  # wraps lazily; nothing is compiled until called
    try:
        assert graphs.key_for(layout, 1, "auto", "positive") != eager_key
    finally:
        model.compile_blocks(False)
    assert graphs.key_for(layout, 1, "auto", "positive") == eager_key


def _generation(graphs, layout, prompt: str, seed: int, model, steps=(0.9, 0.5)):
    """One generation as the sampler runs it: prefilled, its prefix named (`cache.prefix_id`), stepped, released.
    Every step is checked against eager decode."""
    branch = _prefilled(graphs, layout, seed=seed)
    branch.cache.prefix_id = prompt
    x = torch.randn(1, 16, CHANNELS, generator=torch.Generator().manual_seed(seed))
    for t in steps:
        tt = torch.full((1,), t)
        assert torch.equal(graphs(branch, x * t, tt), model.decode(branch, x * t, tt))
    status = graphs.describe()
    graphs.release(branch)
    graphs.end_generation()
    return branch, status


def test_a_gpu_bound_key_stays_eager_until_the_same_prompt_comes_again(model):
    """A new key whose step the GPU bounds (the host's share of it below `launch_bound_share`) is not worth a
    capture: its first generation decodes eagerly. A changed prompt of the same length (same key, another prefix)
    stays eager too (on the H200 its capture cost about 90 ms and bought nothing); the same prompt again (a new seed)
    captures and replays, and its graph entry keeps the prefix for the runs after it."""
    recorder = Recorder()
    graphs = DecodeGraphs(model, capture=recorder, launch_bound_share=1.5)  # no step reaches 1.5: GPU-bound
    layout = _layout()
    first, status = _generation(graphs, layout, "prompt A", 0, model, steps=(0.9, 0.5, 0.2))
    assert recorder.captures == 0 and first.first_sight == "gpu_bound" and "decoded eagerly" in status
    _branch, status = _generation(graphs, layout, "prompt B", 1, model)  # changed prompt, same length
    assert recorder.captures == 0 and "prompt is not the last one of its length" in status
    _branch, status = _generation(graphs, layout, "prompt B", 2, model)  # the same prompt, a new seed
    assert recorder.captures == 1 and status == "replay"
    entry = graphs.entries[graphs.key_for(layout, 1, "auto", "positive")]
    assert entry.branch.cache.prefix_id == "prompt B"  # kept with the entry: the next rerun skips the prefill


def test_a_generation_without_a_verdict_keeps_the_earlier_one(model):
    """A generation interrupted before its timed step (or one whose every timed step was deferred while the warm-up
    ran) reaches no verdict; the key keeps the GPU-bound verdict an earlier one reached, so the next changed prompt of
    that length still decodes eagerly instead of capturing."""
    recorder = Recorder()
    graphs = DecodeGraphs(model, capture=recorder, launch_bound_share=1.5)
    layout = _layout()
    _generation(graphs, layout, "prompt A", 0, model)
    _generation(graphs, layout, "prompt B", 1, model, steps=())  # interrupted before its first step
    key = graphs.key_for(layout, 1, "auto", "positive")
    assert graphs.seen[key] == ("gpu_bound", "prompt B")
    _generation(graphs, layout, "prompt C", 2, model)
    assert recorder.captures == 0


def test_a_prefix_without_a_name_never_counts_as_the_same_prompt(model):
    """Without a prefix id (prefix cache off, or a conditioning with no content hash) nothing tells a rerun from a
    changed prompt: a GPU-bound key then stays eager."""
    recorder = Recorder()
    graphs = DecodeGraphs(model, capture=recorder, launch_bound_share=1.5)
    layout = _layout()
    for seed in range(3):
        _generation(graphs, layout, None, seed, model)
    assert recorder.captures == 0


def test_a_launch_bound_key_is_timed_at_its_second_step_and_captures_at_its_third(model):
    """On the CPU the host runs every op itself, so a step is all host time: launch-bound. A key's first step only
    runs (it carries one-time costs: first launches, a new shape's set-up), its second is timed, the third captures,
    the rest replay. A later key is timed at its own second step."""
    recorder = Recorder()
    graphs = DecodeGraphs(model, capture=recorder)  # the default share
    layout = _layout()
    branch = _prefilled(graphs, layout)
    x = torch.randn(1, 16, CHANNELS)
    steps = (0.9, 0.7, 0.5, 0.3, 0.2)
    outputs = []
    for number, t in enumerate(steps):
        outputs.append(graphs(branch, x * t, torch.full((1,), t)))
        if number == 0:  # not timed: no verdict yet, nothing captured
            assert getattr(branch, "first_sight", None) is None and not graphs.host_shares
    assert branch.first_sight == "launch_bound" and branch.host_share >= 0.9
    assert recorder.captures == 1 and recorder.graphs[0].replays == 3
    for out, t in zip(outputs, steps, strict=True):
        assert torch.equal(out, model.decode(branch, x * t, torch.full((1,), t)))
    graphs.release(branch)
    graphs.end_generation()
    other = _prefilled(graphs, _layout(text=7))  # a new prompt length: a new key
    graphs(other, x, torch.full((1,), 0.9))
    assert getattr(other, "first_sight", None) is None and not graphs.host_shares
    graphs(other, x * 0.7, torch.full((1,), 0.7))
    assert other.first_sight == "launch_bound" and len(graphs.host_shares) == 1
    graphs(other, x * 0.5, torch.full((1,), 0.5))
    assert recorder.captures == 2


def test_while_the_warmup_runs_the_share_is_the_threads_cpu_time(model, monkeypatch):
    """The warm-up's threads take the interpreter now and then, which reads as host wall time: a restart's second
    step, timed while the VAE's kernels still loaded, captured a GPU-bound 1024^2 step. While `background_busy` says
    so, the host's share is this thread's CPU time: a step below the share gives no verdict (the next is timed again),
    one above it is launch-bound all the same."""
    import qwen21_nodes.qwen21_core.dit.decode_graphs as decode_graphs

    clock = {"wall": 0.0, "cpu": 0.0}
    spent = {"wall": 0.010, "cpu": 0.004}  # per decode: 10 ms of wall time, 4 of them this thread's CPU time
    monkeypatch.setattr(decode_graphs.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(decode_graphs.time, "thread_time", lambda: clock["cpu"])

    class Timed:  # the model's decode, advancing the fake clocks
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def decode(self, *args, **kwargs):
            clock["wall"] += spent["wall"]
            clock["cpu"] += spent["cpu"]
            return self.inner.decode(*args, **kwargs)

    recorder = Recorder()
    busy = [True]
    graphs = DecodeGraphs(model, capture=recorder, background_busy=lambda: busy[0])
    branch = _prefilled(graphs, _layout())
    graphs.transformer = Timed(model)
    x = torch.randn(1, 16, CHANNELS)
    for t in (0.9, 0.8, 0.7):  # the first only runs; the next two read a CPU share of 0.4: no verdict
        tt = torch.full((1,), t)
        assert torch.equal(graphs(branch, x * t, tt), model.decode(branch, x * t, tt))
    assert getattr(branch, "first_sight", None) is None and graphs.deferred_shares == [0.4, 0.4]
    assert "no verdict in 2 steps while the kernel warm-up ran, host CPU shares 0.40-0.40" in graphs.describe()
    assert recorder.captures == 0
    busy[0] = False  # done: the wall share (all of it here) decides
    graphs(branch, x * 0.6, torch.full((1,), 0.6))
    assert branch.first_sight == "launch_bound" and graphs.host_shares == [1.0]
    graphs(branch, x * 0.5, torch.full((1,), 0.5))
    assert recorder.captures == 1
    graphs.release(branch)
    graphs.end_generation()
    busy[0] = True
    spent["cpu"] = 0.0095  # the thread's own work fills the step even while the warm-up runs: launch-bound
    other = _prefilled(graphs, _layout(text=7))
    for t in (0.9, 0.8):
        graphs(other, x * t, torch.full((1,), t))
    assert other.first_sight == "launch_bound" and graphs.host_shares == [0.95] and not graphs.deferred_shares
    graphs.release(other)
    graphs.end_generation()
    # where the thread's clock is coarse (Windows), no step gives a verdict while the warm-up runs, however high
    monkeypatch.setattr(decode_graphs, "THREAD_CLOCK_FINE", False)
    third = _prefilled(graphs, _layout(text=9))
    for t in (0.9, 0.8, 0.7):
        graphs(third, x * t, torch.full((1,), t))
    assert third.first_sight is None and graphs.host_shares == [] and recorder.captures == 1
    busy[0] = False
    graphs(third, x * 0.6, torch.full((1,), 0.6))
    assert third.first_sight == "launch_bound"


def test_seen_keys_are_bounded_and_forgotten_with_the_entries(model):
    graphs = DecodeGraphs(model, capture=Recorder(), launch_bound_share=1.5)
    for length in range(3, 3 + 300):
        branch = graphs.new_branch(_layout(text=length), 1, "auto", "positive")
        graphs.release(branch)
    from qwen21_nodes.qwen21_core.dit.decode_graphs import SEEN_KEYS_KEPT

    assert len(graphs.seen) == SEEN_KEYS_KEPT
    graphs.clear()
    assert not graphs.seen


def test_the_status_speaks_of_this_generation_only(model):
    """A generation that decodes eagerly says "off", even after earlier generations replayed other keys' graphs
    (the status line once read "replay, ... decoded eagerly" for an eager generation)."""
    recorder = Recorder()
    graphs = DecodeGraphs(model, capture=recorder, launch_bound_share=0)  # capture at once
    x = torch.randn(1, 16, CHANNELS)
    branch = _prefilled(graphs, _layout())
    for t in (0.9, 0.5):
        graphs(branch, x * t, torch.full((1,), t))
    assert graphs.describe() == "replay"
    graphs.release(branch)
    graphs.end_generation()
    graphs.launch_bound_share = 1.5  # from now on every first-seen key is GPU-bound: eager
    other = _prefilled(graphs, _layout(text=7))  # a new prompt length: a new key, timed at its second step
    for t in (0.9, 0.5):
        graphs(other, x * t, torch.full((1,), t))
    assert graphs.describe().startswith("off: ") and "decoded eagerly" in graphs.describe()


ASYNC_CHILD = """
import torch
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer, uniform_plan
from qwen21_nodes.qwen21_core.quant.weights import FORMATS
from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER

assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
torch.manual_seed(0)
base = QwenImage21Transformer(TINY_TRANSFORMER).to("cuda", torch.bfloat16).eval()
config = base.config
layout = build_layout(torch.zeros(7, dtype=torch.bool), [], (8, 8))
embeds = torch.randn(7, config.context_in_dim, device="cuda", dtype=torch.bfloat16)
x = torch.randn(1, 64, config.in_channels, device="cuda", dtype=torch.bfloat16)


def generation(model, fmt):
    with torch.inference_mode():
        graphs = DecodeGraphs(model, launch_bound_share=0)
        branch = graphs.new_branch(layout, 1, "auto", "positive")
        model.prefill(branch, embeds, None)
        for step in (0.9, 0.6, 0.3, 0.1):
            t = torch.full((1,), step, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(graphs(branch, x * step, t), model.decode(branch, x * step, t)), fmt
        assert graphs.describe() == "replay", graphs.describe()
        graphs.clear()
        branch.release()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


for fmt in ("bf16", "fp8", "int8_convrot"):
    model = base if fmt == "bf16" else base.quantized_copy(uniform_plan(FORMATS[fmt], config.num_layers))
    generation(model, fmt)  # the first also sets up what lives as long as the process (cuBLAS workspaces)
    before = torch.cuda.memory_allocated()
    generation(model, fmt)
    assert torch.cuda.memory_allocated() - before < 2**20, (fmt, torch.cuda.memory_allocated() - before)
    print(fmt, "replayed bit-identical")
"""


@pytest.mark.gpu
def test_decode_graphs_replay_under_cudamallocasync_with_the_direct_launch():
    """ComfyUI's default allocator: with every Triton kernel launched directly (kernels/launch.py), a quantised or
    bf16 step is captured and replays bit-identical to eager, and clearing the graphs gives their memory back.
    A child process: a failed capture under cudaMallocAsync aborts its process."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    env.pop("QWEN21_FAST_LAUNCH", None)
    done = subprocess.run([sys.executable, "-P", "-c", ASYNC_CHILD], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    for fmt in ("bf16", "fp8", "int8_convrot"):
        assert f"{fmt} replayed bit-identical" in output
    assert "uncaptured free of a captured allocation" not in output  # no tensor outlives its capture
