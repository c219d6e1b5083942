"""Prefill graphs (dit/prefill_graphs.py): a text prompt's prefill replayed from a graph of its padded length.

On the CPU with the stand-in capture of fake_cuda_graph.py (recorded ops replay on the recorded tensors, Python code
does not run again), so "replay equals eager" can fail here the way it would on the GPU. The CPU's quantised blocks
dequantise per layer (fp32 GEMMs, which may round differently at another row count), so the CPU tests let that path
capture and compare to 1e-5; on the GPU, with real CUDA graphs and W8A8 GEMMs, the K/V must equal the eager
prefill's bit for bit, at prompt lengths across every bucket."""

import pytest
import torch
from dit_reference import CONTEXT, our_dit, prompt_mask, reference_dit
from fake_cuda_graph import RecordingCapture
from qwen21_nodes.qwen21_core.dit import prefill_graphs
from qwen21_nodes.qwen21_core.dit.prefill_graphs import MAX_TOKENS, PrefillGraphs, bucket_for
from qwen21_nodes.qwen21_core.dit.sequence import build_layout

pytest.importorskip("diffusers")


class Capture:
    """PrefillGraphs' `capture` argument over RecordingCapture: counts captures, may fail on purpose."""

    def __init__(self, fail: BaseException | None = None):
        self.recorder = RecordingCapture(fail)

    @property
    def captures(self) -> int:
        return self.recorder.captures

    def __call__(self, run):
        graph, _ = self.recorder(lambda _x, _t: run(), None, None)
        return graph


def _quantized(model, fmt: str = "fp8"):
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    return model.quantized_copy(uniform_plan(FORMATS[fmt], model.config.num_layers))


@pytest.fixture(scope="module")
def model():
    """Quantised blocks: the ones prefill graphs serve (on the CPU they dequantise per layer)."""
    return _quantized(our_dit(reference_dit()))


@pytest.fixture(autouse=True)
def cpu_gemms_count_as_row_exact(request, monkeypatch):
    """On the CPU the quantised blocks take the weight-only path: let it capture here (tolerance checks), except in
    the tests about that very rule."""
    if "weight_only_rule" not in request.keywords:
        monkeypatch.setattr(prefill_graphs, "ROW_EXACT_GEMMS", (*prefill_graphs.ROW_EXACT_GEMMS, "weight_only"))


def _layout(text: int, shapes=()):
    """A text-only prompt of `text` tokens, or a prompt with condition images of `shapes`."""
    mask = prompt_mask(text, list(shapes)) if shapes else torch.zeros(text, dtype=torch.bool)
    return build_layout(mask, list(shapes), (4, 4))


def _embeds(layout, seed: int, images: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.prefix_len - 3 * images * 4, CONTEXT, generator=g)


def _prefix_kv(branch) -> torch.Tensor:
    """Every layer's prefix K and V, stacked."""
    cache = branch.cache
    return torch.stack([torch.stack(cache.prefix(layer)) for layer in range(cache.shape.num_layers)])


def _eager_kv(model, layout, embeds) -> torch.Tensor:
    branch = model.new_branch(layout, 1)
    model.prefill(branch, embeds, None)
    return _prefix_kv(branch)


def test_buckets_are_the_kernels_m_buckets():
    assert [bucket_for(n) for n in (1, 9, 16, 17, 100, 128, 129, 300)] == [1, 16, 16, 32, 128, 128, 256, 512]


def test_first_sight_eager_then_capture_then_replay_each_equal_to_eager(model):
    """Prompts of 9, 11 and 13 tokens share the 16-row bucket: the first prefills eagerly, the second captures, the
    third replays; each fills the cache with what the eager prefill computes (rows past a prompt never reach it)."""
    capture = Capture()
    graphs = PrefillGraphs(model, capture=capture)
    for number, text in enumerate((9, 11, 13)):
        layout = _layout(text)
        embeds = _embeds(layout, seed=number)
        branch = model.new_branch(layout, 1)
        graphs(branch, embeds)
        assert branch.cache.filled
        torch.testing.assert_close(_prefix_kv(branch), _eager_kv(model, layout, embeds), rtol=1e-5, atol=1e-5)
        assert capture.captures == (0 if number == 0 else 1)
        if number == 0:
            assert graphs.describe() == f"eager: {prefill_graphs.FIRST_SIGHT_REASON}"
            graphs.end_generation()
    assert graphs.replays == 2
    assert graphs.describe() == "replay (2)"  # this generation's (end_generation cleared the first one's note)
    (entry,) = graphs.entries.values()
    assert tuple(entry.kv.shape[:4]) == (model.config.num_layers, 2, 1, 16)  # one K/V buffer of the bucket's rows


def test_a_longer_prompt_after_a_shorter_one_in_the_same_bucket_is_not_polluted(model):
    """The padded rows hold the last replay's values: a longer prompt's rows must come from its own input."""
    graphs = PrefillGraphs(model, capture=Capture())
    for text, seed in ((14, 0), (9, 1), (14, 2), (9, 3)):
        layout = _layout(text)
        embeds = _embeds(layout, seed)
        branch = model.new_branch(layout, 1)
        graphs(branch, embeds)
        torch.testing.assert_close(_prefix_kv(branch), _eager_kv(model, layout, embeds), rtol=1e-5, atol=1e-5)


@pytest.mark.weight_only_rule
def test_gemms_that_are_not_row_exact_prefill_eagerly(model):
    """The weight-only path (the CPU, fp8 below SM 8.9, QWEN21_QUANT_GEMM=weight_only) multiplies in bf16, which may
    round differently at the padded row count: no graph there."""
    capture = Capture()
    graphs = PrefillGraphs(model, capture=capture)
    layout = _layout(9)
    for _ in range(3):
        graphs(model.new_branch(layout, 1), _embeds(layout, 0))
    assert capture.captures == 0 and "the weight_only path in the blocks" in graphs.describe()


def test_padded_k_v_land_in_every_cache_storage_as_the_eager_prefill_writes_them():
    """store_padded_prefix against prefill_targets + store_prefix, per layer, for every format, placement and layout:
    the same bytes (the prompt's rows of a longer buffer)."""
    from qwen21_nodes.qwen21_core.dit.kv_cache import PrefixKVCache

    layers, rows, heads, dim = 3, 5, 2, 8
    padded = torch.randn(layers, 2, 1, 8, heads, dim)
    combos = [(fmt, "gpu", "split") for fmt in ("bf16", "fp8", "fp8_v", "int8")]
    combos += [("bf16", "cpu", "split"), ("fp8", "cpu", "split"), ("bf16", "gpu", "joint")]
    for fmt, placement, layout in combos:
        made = [PrefixKVCache(layers, 1, rows, 4, heads, dim, torch.float32, "cpu", fmt=fmt, placement=placement,
                              layout=layout) for _ in range(2)]  # fmt: skip
        made[0].store_padded_prefix(padded)
        for layer in range(layers):
            k, v = made[1].prefill_targets(layer)
            k.copy_(padded[layer, 0, :, :rows])
            v.copy_(padded[layer, 1, :, :rows])
            made[1].store_prefix(layer)
        for cache in made:
            cache.begin_step()  # the host placement brings its layers over from here
        for layer in range(layers):
            got, want = ([t.clone() for t in cache.prefix(layer)] for cache in made)
            for cache in made:
                cache.done_with(layer)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (fmt, placement, layout, layer)
    with pytest.raises(ValueError, match="do not cover"):
        made[0].store_padded_prefix(padded[:, :, :, :3])


def test_bf16_blocks_prefill_eagerly_saying_why():
    """bf16 is the exact path, and its GEMMs may round differently at a padded row count: no graph there."""
    plain = our_dit(reference_dit())
    capture = Capture()
    graphs = PrefillGraphs(plain, capture=capture)
    layout = _layout(9)
    for _ in range(3):
        branch = plain.new_branch(layout, 1)
        graphs(branch, _embeds(layout, 0))
        assert branch.cache.filled
    assert capture.captures == 0
    assert "bf16 GEMMs in the blocks" in graphs.describe()


def test_lora_side_paths_prefill_eagerly_and_their_removal_brings_the_graphs_back():
    """A side path's GEMMs are bf16 (they may round differently at a padded row count): eager while one is attached."""
    quantised = _quantized(our_dit(reference_dit()))
    capture = Capture()
    graphs = PrefillGraphs(quantised, capture=capture)
    layer = quantised.transformer_blocks[0].attn.to_out
    g = torch.Generator().manual_seed(0)
    layer.set_side_paths([(slice(0, layer.out_features), torch.randn(2, layer.in_features, generator=g),
                           torch.randn(layer.out_features, 2, generator=g))])  # fmt: skip
    layout = _layout(9)
    for _ in range(3):
        branch = quantised.new_branch(layout, 1)
        graphs(branch, _embeds(layout, 0))
        torch.testing.assert_close(_prefix_kv(branch), _eager_kv(quantised, layout, _embeds(layout, 0)), rtol=0, atol=0)
    assert capture.captures == 0 and "LoRA side paths" in graphs.describe()
    layer.set_side_paths([])
    for _ in range(2):
        graphs(quantised.new_branch(layout, 1), _embeds(layout, 0))
    assert capture.captures == 1


def test_condition_images_and_long_prompts_prefill_eagerly_saying_why(model, monkeypatch):
    capture = Capture()
    graphs = PrefillGraphs(model, capture=capture)
    layout = _layout(5, shapes=((4, 4),))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        branch = model.new_branch(layout, 1)
        graphs(branch, _embeds(layout, 0, images=1), torch.randn(16, model.config.in_channels, generator=g))
        assert branch.cache.filled
    assert capture.captures == 0
    assert "condition images" in graphs.describe()
    monkeypatch.setattr(prefill_graphs, "MAX_TOKENS", 8)
    layout = _layout(9)
    for _ in range(3):
        graphs(model.new_branch(layout, 1), _embeds(layout, 0))
    assert capture.captures == 0
    assert "longer than 8 tokens" in graphs.describe()
    assert MAX_TOKENS == 512


def test_a_failed_capture_is_remembered_and_prefills_eagerly(model):
    capture = Capture(fail=RuntimeError("boom"))
    graphs = PrefillGraphs(model, capture=capture)
    layout = _layout(9)
    embeds = _embeds(layout, 0)
    for _ in range(4):
        branch = model.new_branch(layout, 1)
        graphs(branch, embeds)
        torch.testing.assert_close(_prefix_kv(branch), _eager_kv(model, layout, embeds), rtol=0, atol=0)
    assert capture.captures == 1  # not retried
    assert "capture failed (RuntimeError: boom)" in graphs.describe()


def test_no_capture_without_room_for_it_and_the_decode_after_it(model, monkeypatch):
    """A capture takes its K/V buffer and pool from the memory the decode steps after it need: without room for both
    the prefill runs eagerly, and the bucket captures later once there is room (not remembered as a failure)."""
    capture = Capture()
    graphs = PrefillGraphs(model, capture=capture)
    layout = _layout(9)
    budgets = []

    def free(device, budget):
        budgets.append(budget)
        return prefill_graphs.DECODE_HEADROOM_BYTES  # the decode's room, nothing beyond it

    graphs.budget = 24 * 2**30  # the pipeline's budget is what the room is measured under
    monkeypatch.setattr(prefill_graphs, "device_free_bytes", free)
    for _ in range(3):
        branch = model.new_branch(layout, 1)
        graphs(branch, _embeds(layout, 0))
        assert branch.cache.filled
    assert capture.captures == 0 and "no room for a 16-row graph" in graphs.describe()
    assert budgets and set(budgets) == {24 * 2**30}
    monkeypatch.setattr(prefill_graphs, "device_free_bytes", lambda device, budget: 2**62)
    graphs(model.new_branch(layout, 1), _embeds(layout, 0))
    assert capture.captures == 1 and graphs.replays == 1


def test_moved_weights_drop_the_graphs_and_at_most_max_entries_are_kept(model, monkeypatch):
    capture = Capture()
    graphs = PrefillGraphs(model, max_entries=2, capture=capture)
    for text in (9, 9, 20, 20, 40, 40):  # buckets 16, 32, 64: each seen, then captured
        layout = _layout(text)
        graphs(model.new_branch(layout, 1), _embeds(layout, 0))
    assert capture.captures == 3
    assert [key[0] for key in graphs.entries] == [32, 64]  # the least recently used bucket went
    monkeypatch.setattr(prefill_graphs, "weights_signature", lambda transformer: ("moved",))
    layout = _layout(40)
    graphs(model.new_branch(layout, 1), _embeds(layout, 0))
    assert "weights moved" in graphs.describe()
    assert not graphs.entries and graphs.seen == {(64, model.dtype, str(model.device), "auto")}


def test_the_sampler_prefills_through_the_runner(model):
    """The sampler hands its prefill to the runner (the pipeline passes its PrefillGraphs with decode graphs on)."""
    from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
    from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER
    from qwen21_nodes.qwen21_core.sampler import Sampler

    calls = []

    def runner(branch, embeds, cond_tokens):
        calls.append(branch.layout.prefix_len)
        model.prefill(branch, embeds, cond_tokens)

    text = 9
    prompt = PromptEmbedding(torch.randn(text, CONTEXT), torch.zeros(text, dtype=torch.bool))
    cond = Conditioning(positive=prompt, height=64, width=64)
    sampler = Sampler(model, QWEN21_SCHEDULER, torch.zeros(16), torch.ones(16), prefill_runner=runner)
    sampler.sample([cond], height=64, width=64, steps=2, seed=0)
    assert calls == [text]


GPU_LENGTHS = (70, 100, 128, 9, 17, 33, 65, 129, 150, 257, 300, 384, 385, 512)  # every bucket from 16 to 512


@pytest.mark.gpu
@pytest.mark.weight_only_rule
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int8_convrot"])
def test_gpu_graph_replay_matches_the_eager_prefill_bit_for_bit(fmt):
    """Real CUDA graphs on the GPU, each quantised format: the replayed prefill's K/V equal the eager prefill's
    exactly, for prompts of many lengths, several in one bucket (the W8A8 blocks compute a row from that row alone,
    whatever the row count; attention is causal)."""
    if fmt == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 W8A8 needs SM 8.9+")
    model = _quantized(our_dit(reference_dit()).to("cuda", torch.bfloat16), fmt)
    graphs = PrefillGraphs(model, max_entries=len(GPU_LENGTHS))
    differing = []
    with torch.inference_mode():
        for number, text in enumerate(GPU_LENGTHS):
            layout = _layout(text)
            embeds = _embeds(layout, number).to("cuda", torch.bfloat16)
            for _ in range(2):  # a new bucket's first prompt is eager: the second call captures
                branch = model.new_branch(layout, 1)
                graphs(branch, embeds)
            if not torch.equal(_prefix_kv(branch), _eager_kv(model, layout, embeds)):
                differing.append(text)
    assert not differing, f"{fmt}: replayed K/V differ from the eager prefill's at {differing} tokens"
    assert graphs.replays == 2 * len(GPU_LENGTHS) - len({bucket_for(n) for n in GPU_LENGTHS}), graphs.describe()


ASYNC_CHILD = """
import torch
from qwen21_nodes.qwen21_core.dit.prefill_graphs import PrefillGraphs
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer, uniform_plan
from qwen21_nodes.qwen21_core.quant.weights import FORMATS
from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER

assert torch.cuda.get_allocator_backend() == "cudaMallocAsync"
torch.manual_seed(0)
base = QwenImage21Transformer(TINY_TRANSFORMER).to("cuda", torch.bfloat16).eval()
config = base.config


def kv(branch):
    return torch.stack([torch.stack(branch.cache.prefix(i)) for i in range(config.num_layers)])


for fmt in ("fp8", "int8_convrot"):
    model = base.quantized_copy(uniform_plan(FORMATS[fmt], config.num_layers))
    with torch.inference_mode():
        graphs = PrefillGraphs(model)
        for text in (20, 25, 30):  # bucket 32: eager, capture, replay
            layout = build_layout(torch.zeros(text, dtype=torch.bool), [], (8, 8))
            embeds = torch.randn(text, config.context_in_dim, device="cuda", dtype=torch.bfloat16)
            branch, eager = model.new_branch(layout, 1), model.new_branch(layout, 1)
            graphs(branch, embeds)
            model.prefill(eager, embeds, None)
            assert torch.equal(kv(branch), kv(eager)), fmt
            branch.release()
            eager.release()
        assert graphs.describe().startswith("replay (2)"), graphs.describe()
        before = torch.cuda.memory_allocated()
        graphs.clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() < before, (fmt, before, torch.cuda.memory_allocated())
    print(fmt, "prefill replayed bit-identical")
"""


@pytest.mark.gpu
def test_prefill_graphs_replay_under_cudamallocasync_with_the_direct_launch():
    """ComfyUI's default allocator (a child process: a failed capture under it aborts its process): the quantised
    prefill is captured, replays bit-identical to eager, and clearing the graphs gives their memory back."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    env.pop("QWEN21_FAST_LAUNCH", None)
    done = subprocess.run([sys.executable, "-P", "-c", ASYNC_CHILD], env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    for fmt in ("fp8", "int8_convrot"):
        assert f"{fmt} prefill replayed bit-identical" in output
    assert "uncaptured free of a captured allocation" not in output  # no tensor outlives its capture
