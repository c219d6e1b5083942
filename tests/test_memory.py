"""Memory: the prefetch pipeline's bookkeeping, layer streaming (same outputs as resident), the K/V cache's
formats and placements (error bounds, identical placements), the placement planner, the local memory manager and
what our nodes ask ComfyUI's memory manager for. CPU tests use the CPU as the device (copies are immediate, the
bookkeeping is the same); the marked GPU tests check the real streams, events and graph replay."""

from __future__ import annotations

import math
import types

import pytest
import torch
from dit_reference import CHANNELS, CONTEXT, TINY_DIT, our_dit, prompt_mask, reference_dit
from qwen21_nodes.kernels.kv_quant import dequantize_kv, quantize_kv
from qwen21_nodes.nodes import host, memory_adapter
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit.kv_cache import CacheShape, KVCacheSpec, PrefixKVCache
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer
from qwen21_nodes.qwen21_core.memory.manager import LocalMemoryManager
from qwen21_nodes.qwen21_core.memory.planner import DeviceMemoryError, plan_sampling
from qwen21_nodes.qwen21_core.memory.prefetch import SlotPrefetcher
from qwen21_nodes.qwen21_core.memory.streaming import LayerStreamer
from qwen21_nodes.qwen21_core.request import SampleRequest

pytest.importorskip("diffusers")
GIB = 2**30


@pytest.fixture(scope="module")
def model():
    return our_dit(reference_dit())


def _inputs(model, seed=0, shapes=((4, 4),), target=(4, 4), batch=1):
    gen = torch.Generator().manual_seed(seed)
    mask = prompt_mask(5, list(shapes))
    layout = build_layout(mask, list(shapes), target)
    embeds = torch.randn(mask.shape[0], CONTEXT, generator=gen)
    cond = torch.randn(sum(h * w for h, w in shapes), CHANNELS, generator=gen)
    x = torch.randn(batch, target[0] * target[1], CHANNELS, generator=gen)
    return layout, embeds, cond, x


def _velocity(model, layout, embeds, cond, x, kv=None):
    branch = model.new_branch(layout, x.shape[0], kv=kv)
    model.prefill(branch, embeds, cond)
    v = model.decode(branch, x, torch.full((x.shape[0],), 0.3))
    branch.release()
    return v


def _psnr(a, b):
    return 10 * math.log10(b.abs().max().item() ** 2 / max((a - b).pow(2).mean().item(), 1e-30))


# ---- prefetch bookkeeping --------------------------------------------------------------------------------


def test_prefetcher_copies_each_item_once_per_pass_into_its_slot_ahead_of_use():
    items = {i: torch.full((8,), i, dtype=torch.uint8) for i in (3, 5, 6, 9, 12)}
    prefetcher = SlotPrefetcher(torch.device("cpu"), slot_bytes=8, slots=2)
    prefetcher.set_items(items)
    for _ in range(2):  # two passes: the slots are refilled from the start every pass
        prefetcher.log.clear()
        prefetcher.begin()
        assert prefetcher.log == [(3, 0), (5, 1)]  # the first two, before any layer runs
        for index in sorted(items):
            slot = prefetcher.acquire(index)
            assert torch.equal(slot, items[index])  # the layer sees its own data
            prefetcher.release(index)
        assert prefetcher.log == [(3, 0), (5, 1), (6, 0), (9, 1), (12, 0)]  # each refill goes to the freed slot
    with pytest.raises(ValueError, match="larger than a slot"):
        prefetcher.set_items({0: torch.zeros(9, dtype=torch.uint8)})


# ---- layer streaming -------------------------------------------------------------------------------------


@pytest.mark.parametrize("resident", [0, 1])
def test_streamed_blocks_give_the_resident_output_exactly(model, resident):
    layout, embeds, cond, x = _inputs(model)
    with torch.inference_mode():
        want = _velocity(model, layout, embeds, cond, x)
        model.stream_blocks(resident)
        try:
            assert model.resident_blocks == resident and model.streaming_signature() == tuple(range(resident, 2))
            got = _velocity(model, layout, embeds, cond, x)
        finally:
            model.place("cpu")  # back to whole
    assert model.streamer is None and torch.equal(got, want)
    assert torch.equal(_velocity(model, layout, embeds, cond, x), want)  # and whole again afterwards


def test_streamer_moves_layers_between_host_and_device_without_changing_them():
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    before = [layer.weight.detach().clone() for layer in layers]
    streamer = LayerStreamer(layers, torch.device("cpu"))
    streamer.set_resident(1)
    assert streamer.streamed == [1, 2, 3] and streamer.device_bytes == streamer.layer_bytes + streamer.slot_bytes
    streamer.begin()
    for i, layer in enumerate(layers):
        streamer.before(i)
        assert torch.equal(layer.weight, before[i])  # what a streamed layer computes with, when it runs
        streamer.after(i)
    streamer.set_resident(4)
    assert streamer.streamed == [] and all(
        torch.equal(layer.weight, w) for layer, w in zip(layers, before, strict=True)
    )
    # layers of other shapes (a GGUF file's blocks in other block types) stream too: a slot holds the largest
    mixed = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Linear(8, 16, bias=False)]
    weights = [layer.weight.detach().clone() for layer in mixed]
    streamer = LayerStreamer(mixed, torch.device("cpu"))
    streamer.set_resident(1)
    assert streamer.streamed == [1, 2] and streamer.layer_bytes == max(b for _, b in streamer.layouts)
    streamer.begin()
    for i, layer in enumerate(mixed):
        streamer.before(i)
        assert torch.equal(layer.weight, weights[i])
        streamer.after(i)


def test_weights_made_under_inference_mode_stream(model):
    """ComfyUI runs its nodes, the loader too, under torch.inference_mode, so the weights are inference tensors.
    Pointing them at staging slots made a streamed layer fail at its next use ("Inference tensors do not track
    version counter", our text encoder inside ComfyUI --novram on the H200): the parameters are replaced instead."""
    from qwen21_nodes.qwen21_core.memory.streaming import place_with_streaming
    from qwen21_nodes.qwen21_core.text.encoder import Qwen21TextEncoder
    from qwen21_nodes.qwen21_core.text.tiny import build_tiny_text_encoder

    with torch.inference_mode():  # as ComfyUI's loader node runs
        stack = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        full, processor = build_tiny_text_encoder()
        encoder = Qwen21TextEncoder(full.model.eval(), processor)
    assert stack[0].weight.is_inference()
    x = torch.randn(2, 8)
    with torch.inference_mode():
        want = stack(x)
        want_text = encoder.encode_prompts(["a cat"])[0].embeds
    streamer = place_with_streaming(stack, stack, None, "cpu", 1, hooks_on=stack)
    assert streamer.streamed == [1, 2, 3]
    with torch.inference_mode():
        assert torch.equal(stack(x), want)
    with torch.no_grad():
        assert torch.equal(stack(x), want)
    assert place_with_streaming(stack, stack, streamer, "cpu", None) is None
    with torch.inference_mode():
        assert torch.equal(stack(x), want)  # and whole again
        encoder.place("cpu", 0)
        assert encoder.resident_layers == 0
        assert torch.equal(encoder.encode_prompts(["a cat"])[0].embeds, want_text)
        encoder.place("cpu")  # whole again, inside inference mode as a ComfyUI full load is
        assert torch.equal(encoder.encode_prompts(["a cat"])[0].embeds, want_text)


# ---- the K/V cache -----------------------------------------------------------------------------------------


def test_kv_quantisation_error_per_token_and_head():
    k = torch.randn(3, 40, 4, 32) * torch.rand(3, 40, 4, 1) * 5  # rows of very different magnitudes
    for fmt, bound in (("fp8", 0.04), ("int8", 0.01)):
        q, scale = quantize_kv(k, fmt)
        back = dequantize_kv(q, scale, torch.empty_like(k))
        row_error = (back - k).norm(dim=-1) / k.norm(dim=-1)
        assert scale.shape == k.shape[:-1] and row_error.max() < bound


@pytest.mark.parametrize("fmt,floor", [("fp8", 25), ("fp8_v", 28), ("int8", 35)])
def test_quantised_prefix_cache_against_the_bf16_cache(model, fmt, floor):
    layout, embeds, cond, x = _inputs(model, seed=1)
    with torch.inference_mode():
        exact = _velocity(model, layout, embeds, cond, x)
        lossy = _velocity(model, layout, embeds, cond, x, KVCacheSpec(fmt))
    assert not torch.equal(lossy, exact) and _psnr(lossy, exact) >= floor


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("batch", [1, 2])
def test_host_placement_gives_the_device_placement_exactly(model, fmt, batch):
    layout, embeds, cond, x = _inputs(model, seed=2, batch=batch)
    with torch.inference_mode():
        on_device = _velocity(model, layout, embeds, cond, x, KVCacheSpec(fmt, "gpu"))
        on_host = _velocity(model, layout, embeds, cond, x, KVCacheSpec(fmt, "cpu"))
    assert torch.equal(on_host, on_device)


def test_split_layout_matches_the_joint_layout(model):
    layout, embeds, cond, x = _inputs(model, seed=3)
    with torch.inference_mode():
        joint = _velocity(model, layout, embeds, cond, x, KVCacheSpec(layout="joint"))
        split = _velocity(model, layout, embeds, cond, x, KVCacheSpec(layout="split"))
    assert torch.allclose(split, joint, atol=1e-5, rtol=1e-5)  # one softmax either way, fp32 merge


def test_cache_holds_only_the_prefix_and_one_shared_target_buffer():
    shape = CacheShape(num_layers=32, batch=1, prefix_len=128, target_len=4096, heads=32, head_dim=128,
                       dtype=torch.bfloat16)  # fmt: skip
    row = 2 * 32 * 128 * 2  # K and V of one token in one layer, bf16
    assert shape.device_bytes("bf16", "gpu", "joint") == 32 * (128 + 4096) * row  # the first release's layout
    assert shape.device_bytes("bf16", "gpu") == 32 * 128 * row + 4096 * row  # prefix per layer, target once
    fp8_layer = 2 * (128 * 32 * 128 + 4 * 128 * 32)  # values + one fp32 scale per token and head, K and V
    assert shape.device_bytes("fp8", "gpu") == 32 * fp8_layer + 4096 * row + 128 * row  # + the dequant buffer
    assert shape.device_bytes("fp8", "cpu") == 2 * fp8_layer + 4096 * row + 128 * row  # two staging slots
    assert shape.host_bytes("fp8", "cpu") == 32 * fp8_layer
    cache = PrefixKVCache(2, 1, 5, 7, 2, 8, torch.float32, "cpu", fmt="int8", placement="cpu")
    assert cache.nbytes == CacheShape(2, 1, 5, 7, 2, 8, torch.float32).device_bytes("int8", "cpu")


# ---- the planner ---------------------------------------------------------------------------------------------


def test_planner_keeps_everything_then_moves_the_cache_then_streams_blocks():
    caches = {"gpu": 8 * GIB, "cpu": 1 * GIB}
    kw = dict(cache_bytes=caches, activation_bytes=GIB // 2, block_bytes=GIB // 2, num_blocks=32, slot_bytes=GIB)
    assert plan_sampling(40 * GIB, **kw).resident_blocks == 32 and plan_sampling(40 * GIB, **kw).kv_placement == "gpu"
    roomy = plan_sampling(20 * GIB, **kw)
    assert (roomy.kv_placement, roomy.resident_blocks) == ("cpu", 32)
    tight = plan_sampling(12 * GIB, **kw)  # 12 - 0.5 headroom - 1 cache - 0.5 act - 1 slots = 9 GiB of blocks
    assert (tight.kv_placement, tight.resident_blocks) == ("cpu", 18) and "14 of 32 blocks streamed" in tight.reason
    forced = plan_sampling(40 * GIB, placement="cpu", **kw)
    assert forced.kv_placement == "cpu"
    with pytest.raises(DeviceMemoryError, match="even with every DiT block streamed"):
        plan_sampling(2 * GIB, **kw)


def _planning_pipeline(monkeypatch, free: int, idle: int, resident: int, manage_weights: bool):
    """Just what Qwen21Pipeline.plan_sampling reads, on a pretend CUDA device with `free` bytes free: a DiT of 32
    half-GiB blocks, `resident` of them on the device, and a job with an 8 GiB GPU (1 GiB RAM) K/V cache."""
    from qwen21_nodes.qwen21_core import pipeline
    from qwen21_nodes.qwen21_core.memory import planner, sizing

    monkeypatch.setattr(planner, "device_free_bytes", lambda device, budget=None: free)
    monkeypatch.setattr(sizing, "request_bytes", lambda *a: ({"gpu": 8 * GIB, "cpu": GIB}, GIB // 2))
    transformer = types.SimpleNamespace(transformer_blocks=[None] * 32, streamer=None, layer_bytes=GIB // 2,
                                        resident_blocks=resident, config=None)  # fmt: skip
    fake = types.SimpleNamespace(transformer=transformer, device=torch.device("cuda"), vram_budget=None, dtype=None,
                                 manage_weights=manage_weights, idle_cache_bytes=lambda: idle, workers=None)
    return lambda: pipeline.Qwen21Pipeline.plan_sampling(fake, None, SampleRequest(height=1024, width=1024),
                                                         types.SimpleNamespace(kv_placement="auto"))  # fmt: skip


def test_free_memory_leaves_out_what_cuda_graph_pools_hold(monkeypatch, fake_cuda_memory):
    """Cached blocks count as free, except those in CUDA graphs' private pools: at 24 GB the text encoder was placed
    beside the DiT's idle graphs on the strength of their pool memory, and ran out of memory."""
    from qwen21_nodes.qwen21_core.memory import planner

    segments = [
        {"device": 0, "segment_pool_id": (0, 0), "total_size": 3 * GIB, "allocated_size": GIB},  # 2 GiB cached
        {"device": 0, "segment_pool_id": (4, 1), "total_size": 2 * GIB, "allocated_size": GIB // 2},  # a graph's
        {"device": 1, "segment_pool_id": (5, 1), "total_size": GIB, "allocated_size": 0},  # another GPU's
    ]
    fake_cuda_memory(free=10 * GIB, total=80 * GIB, reserved=5 * GIB, allocated=int(1.5 * GIB), segments=segments)
    device = torch.device("cuda", 0)
    assert planner.graph_pool_idle_bytes(device) == {(4, 1): int(1.5 * GIB)}
    assert planner.device_free_bytes(device) == 10 * GIB + int(3.5 * GIB) - int(1.5 * GIB)  # = 12 GiB
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")  # no graphs, no snapshot
    assert planner.device_free_bytes(device) == int(13.5 * GIB)


def test_the_allocator_snapshot_is_taken_again_only_after_the_allocator_did_something(monkeypatch, fake_cuda_memory):
    """The free-memory query reads graph pools from an allocator snapshot (2.6 ms on the H200 with a session's
    graphs, several times a prompt): kept while the allocator's counts stand still, taken again once they move."""
    from qwen21_nodes.qwen21_core.memory import planner

    activity = {"allocation.all.allocated": 10, "allocation.all.freed": 4}
    segments = [{"device": 0, "segment_pool_id": (4, 1), "total_size": 2 * GIB, "allocated_size": GIB}]
    fake_cuda_memory(free=10 * GIB, total=80 * GIB, reserved=2 * GIB, allocated=GIB, segments=segments,
                     activity=activity)  # fmt: skip
    snapshots = []
    real = torch.cuda.memory_snapshot
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: snapshots.append(1) or real())
    device = torch.device("cuda", 0)
    assert planner.graph_pool_idle_bytes(device) == {(4, 1): GIB}
    planner.graph_pool_idle_bytes(device)[(9, 9)] = 1  # a caller's copy: the kept answer is not changed through it
    assert planner.graph_pool_idle_bytes(device) == {(4, 1): GIB} and len(snapshots) == 1
    segments[0]["allocated_size"] = 0  # a block freed in the graph's pool: the allocator's counts move
    activity["allocation.all.freed"] = 5
    assert planner.graph_pool_idle_bytes(device) == {(4, 1): 2 * GIB} and len(snapshots) == 2


def test_a_rerun_counts_the_previous_runs_idle_cache_as_its_own(monkeypatch):
    """At 24 GB with 4 references the first run's idle 8 GiB cache made the rerun put its K/V in host RAM (2.5x
    slower, bench_e2e on the H200): the idle cache is adopted or evicted, so it counts as free."""
    # 1.5 GiB free beside 32 resident blocks (16 GiB): the 8 GiB GPU cache fits only with the idle one counted
    assert _planning_pipeline(monkeypatch, int(1.5 * GIB), 8 * GIB, 32, True)().kv_placement == "gpu"
    without = _planning_pipeline(monkeypatch, int(1.5 * GIB), 0, 32, True)()
    assert without.kv_placement == "cpu" and without.resident_blocks < 32


def test_under_a_memory_manager_only_the_resident_blocks_count(monkeypatch):
    """ComfyUI placed 20 of 32 blocks: the GPU cache must fit beside those 20 and the staging slots, not beside
    the 32 a whole DiT would be (that over-count made a 24 GB rerun run out of memory)."""
    plan = _planning_pipeline(monkeypatch, 9 * GIB, 0, 20, False)()  # 10 + 8 + 0.5 + 1 slots > 9 + 10 - 0.5
    assert (plan.kv_placement, plan.resident_blocks) == ("cpu", 20)
    assert "20 of 32 blocks resident (placed by the memory manager)" in plan.reason
    roomy = _planning_pipeline(monkeypatch, 11 * GIB, 0, 20, False)()  # 19.5 <= 20.5
    assert roomy.kv_placement == "gpu"
    whole = _planning_pipeline(monkeypatch, 9 * GIB, 0, 32, False)()  # no staging: 16 + 8 + 0.5 <= 9 + 16 - 0.5
    assert whole.kv_placement == "gpu" and "all 32 blocks resident" in whole.reason


# ---- memory managers -----------------------------------------------------------------------------------------


class _Stack:
    """A streamable stand-in: records where it was placed."""

    def __init__(self, layers=10, layer_bytes=GIB, fixed=GIB):
        self.num_layers, self.layer_bytes, self.fixed = layers, layer_bytes, fixed
        self.placed = []
        self.resident = None
        self.weight = torch.nn.Parameter(torch.empty(0))

    def place(self, device, resident_layers=None):
        self.placed.append((str(device), resident_layers))
        self.resident = resident_layers

    def device_weight_bytes(self):
        resident = self.num_layers if self.resident is None else self.resident
        return self.fixed + resident * self.layer_bytes


def test_local_manager_evicts_the_least_recently_used_then_streams(monkeypatch):
    from qwen21_nodes.qwen21_core.memory import planner

    free = {"bytes": 0}
    monkeypatch.setattr(planner, "device_free_bytes", lambda device, budget=None: free["bytes"])
    monkeypatch.setattr(host, "offload_device", lambda: torch.device("cpu"))
    manager = LocalMemoryManager()
    manager.budget = 16 * GIB
    monkeypatch.setattr(memory_adapter, "LOCAL", manager)
    stacks = [_Stack(), _Stack()]
    managed = [memory_adapter.ManagedModules({"m": torch.nn.Linear(1, 1)}, torch.device("cuda"), streamable=s)
               for s in stacks]  # fmt: skip
    for m, s in zip(managed, stacks, strict=True):
        m.full_bytes = s.fixed + s.num_layers * s.layer_bytes  # 11 GiB each
        m.device_bytes = lambda s=s: 0 if not s.placed or s.placed[-1][0] == "cpu" else s.device_weight_bytes()
    free["bytes"] = 30 * GIB
    manager.load(managed[0], GIB)
    assert stacks[0].placed[-1] == ("cuda", None)  # fits whole
    free["bytes"] = 4 * GIB  # the first holds 11 GiB; the second (11 GiB + 1 required) needs the room
    manager.load(managed[1], GIB)
    assert stacks[0].placed[-1][0] == "cpu"  # evicted first; with 4 GiB still short, the second streams every layer:
    assert stacks[1].placed[-1] == ("cuda", 0)  # 4 - 1 required - 0.5 headroom < 1 fixed + 2 staging slots
    free["bytes"] = 10 * GIB  # with 10 GiB free and its own 1 GiB: (10 + 1 - 1 - 0.5 - (1 + 2)) // 1 = 6 layers
    manager.load(managed[1], GIB)
    assert stacks[1].placed[-1] == ("cuda", 6)


def test_a_vram_budget_counts_what_this_process_already_allocated(monkeypatch, fake_cuda_memory):
    """`--vram-budget 16` caps what this process uses on the device in all: with 10 GiB already allocated, 6 GiB are
    left to plan with however much the card has free, and the memory manager (where the CLI's budget goes) streams
    a model of 11 GiB rather than load it whole into the 16."""
    from qwen21_nodes.qwen21_core.memory import planner

    fake_cuda_memory(free=60 * GIB, total=80 * GIB, reserved=10 * GIB, allocated=10 * GIB)
    device = torch.device("cuda", 0)
    assert planner.device_free_bytes(device) == 60 * GIB  # no budget: what the card has free
    left = planner.device_free_bytes(device, 16 * GIB)
    assert left == 6 * GIB, f"a 16 GiB budget with 10 GiB allocated leaves {left / GIB:g} GiB, not 6"
    assert planner.device_free_bytes(device, 8 * GIB) == 0  # already over the budget: nothing, never negative

    monkeypatch.setattr(memory_adapter, "LOCAL", LocalMemoryManager())
    memory_adapter.set_vram_budget(16 * GIB)
    stack = _Stack()  # 10 layers of 1 GiB and 1 GiB of other weights
    managed = memory_adapter.ManagedModules({"m": torch.nn.Linear(1, 1)}, device, streamable=stack)
    managed.full_bytes = 11 * GIB
    managed.device_bytes = lambda: 0
    memory_adapter.LOCAL.load(managed, GIB)
    # 6 GiB left - 1 required - 0.5 headroom - (1 other + 2 staging slots) = 1.5 GiB: one resident layer
    assert stack.placed == [("cuda:0", 1)]


def test_the_real_dit_and_text_encoder_plan_and_take_partial_placements():
    """The managers' arithmetic on the real stacks (not stand-ins): with room for the non-layer weights, the two
    staging slots and one layer, one layer stays resident and what is left on the device is exactly that."""
    from qwen21_nodes.qwen21_core.text.encoder import Qwen21TextEncoder
    from qwen21_nodes.qwen21_core.text.tiny import TINY_HIDDEN_SIZE, build_tiny_processor, tiny_text_encoder_config
    from transformers import Qwen3VLForConditionalGeneration

    # five layers each: room for a resident layer beside the two staging slots
    dit = QwenImage21Transformer(TransformerConfig(**{**TINY_DIT, "num_layers": 5}))
    processor = build_tiny_processor()
    config = tiny_text_encoder_config(processor.tokenizer, TINY_HIDDEN_SIZE)
    config.text_config.num_hidden_layers = 5
    encoder = Qwen21TextEncoder(Qwen3VLForConditionalGeneration(config).eval(), processor)
    assert encoder.num_layers == 5
    for module, stack in ((dit, dit), (encoder.model, encoder)):
        managed = memory_adapter.ManagedModules({"m": module}, torch.device("cpu"), streamable=stack)
        layer, layers = stack.layer_bytes, stack.num_layers
        fixed = managed.full_bytes - layers * layer
        assert layers >= 2 and layer > 0 and fixed > 0
        assert managed.resident_for(managed.full_bytes) is None
        assert managed.resident_for(fixed + 3 * layer) == 1
        stack.place("cpu", 1)
        try:
            slots = stack.streamer.slot_bytes  # two layers, each tensor aligned to 256 bytes in its slot
            assert 2 * layer <= slots <= 2 * (layer + 256 * sum(1 for _ in module.parameters()))
            assert stack.device_weight_bytes() == fixed + layer + slots
        finally:
            stack.place("cpu")
        assert stack.device_weight_bytes() == managed.full_bytes


def test_our_nodes_ask_comfyui_for_partial_loads_of_the_dit_and_text_encoder(monkeypatch):
    """Inside ComfyUI a streamable stack (DiT, text encoder) is loaded through ComfyUI's load_models_gpu with
    force_full_load=False, so ComfyUI may give it less than its size (our patcher streams the rest: the ComfyUI
    tests check that arithmetic in a real ComfyUI); the VAE loads whole."""
    calls = []
    made = []

    def new_patcher(make_model, managed, load_device, offload_device):
        made.append((type(make_model()).__name__, managed.name))
        return types.SimpleNamespace(name=managed.name)

    fake_mm = types.SimpleNamespace(load_models_gpu=lambda models, memory_required, force_full_load: calls.append(
        (models[0].name, memory_required, force_full_load)))  # fmt: skip
    monkeypatch.setattr(host, "IN_COMFYUI", True)
    monkeypatch.setattr(host, "comfy_mm", fake_mm)
    monkeypatch.setattr(host, "offload_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(memory_adapter, "_new_patcher", new_patcher)
    stack = _Stack(layers=4, layer_bytes=100, fixed=50)
    dit = memory_adapter.ManagedModules({"transformer": torch.nn.Linear(4, 4)}, torch.device("cuda"),
                                        streamable=stack, comfy_model=lambda: torch.nn.Identity())  # fmt: skip
    vae = memory_adapter.ManagedModules({"vae": torch.nn.Linear(4, 4)}, torch.device("cuda"))
    dit.load(1234)
    vae.load()
    assert calls == [("transformer", 1234, False), ("vae", 0, True)]
    assert made == [("Identity", "transformer"), ("Qwen21Weights", "vae")]  # the DiT's patcher wraps the MODEL


# ---- GPU: real streams, events and graph replay --------------------------------------------------------------

gpu = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none (run on the H200)"
)


@pytest.mark.gpu
@gpu
def test_streamed_and_host_cached_decode_replays_like_resident_decode_on_the_gpu():
    from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs

    model = our_dit(reference_dit()).to("cuda", torch.bfloat16)
    layout, embeds, cond, x = (t.to("cuda") if torch.is_tensor(t) else t for t in _inputs(model, seed=4))
    embeds, cond, x = embeds.bfloat16(), cond.bfloat16(), x.bfloat16()
    t = torch.full((1,), 0.3, device="cuda", dtype=torch.bfloat16)

    def run(kv):
        graphs = DecodeGraphs(model, launch_bound_share=0)
        branch = graphs.new_branch(layout, 1, kv=kv)
        model.prefill(branch, embeds, cond)
        first, second = graphs(branch, x, t), graphs(branch, x, t)
        eager = model.decode(branch, x, t, in_graph=True)
        status = graphs.describe()
        graphs.clear()
        return first, second, eager, status

    with torch.inference_mode():
        want = run(KVCacheSpec())[2]
        for resident, kv in ((2, KVCacheSpec(placement="cpu")), (0, KVCacheSpec()), (1, KVCacheSpec("fp8", "cpu"))):
            model.stream_blocks(resident)
            first, second, eager, status = run(kv)
            assert status == "replay"
            assert torch.equal(first, eager) and torch.equal(second, eager)
            if kv.fmt == "bf16":
                assert torch.equal(eager, want)  # streaming and host placement change nothing
            model.place("cuda")


@pytest.mark.gpu
@gpu
def test_a_captured_graphs_private_pool_is_not_counted_free_on_the_gpu():
    """On a real allocator: memory a graph freed inside its capture stays in its pool, seen by graph_pool_idle_bytes
    and left out of device_free_bytes (before, the free estimate counted it and the text encoder was placed into it)."""
    from qwen21_nodes.qwen21_core.memory.planner import device_free_bytes, graph_pool_idle_bytes

    x = torch.ones(1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    torch.cuda.empty_cache()
    before = device_free_bytes(torch.device("cuda"))
    with torch.cuda.graph(graph, stream=stream):
        scratch = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        scratch.fill_(1)
        del scratch
        y = x * 2
    graph.replay()
    assert graph_pool_idle_bytes(torch.device("cuda")).get(tuple(graph.pool()), 0) >= 256 * 2**20
    assert before - device_free_bytes(torch.device("cuda")) >= 256 * 2**20
    assert torch.equal(y, x * 2)
    del graph, y
    torch.cuda.empty_cache()


@pytest.mark.gpu
@gpu
def test_on_the_gpu_the_kept_snapshot_follows_graphs_made_and_freed():
    """The kept allocator snapshot (memory/planner.py) against the real allocator: a graph captured after it is seen,
    and so is its pool's memory going back when the graph is freed."""
    from qwen21_nodes.qwen21_core.memory import planner

    device = torch.device("cuda", torch.cuda.current_device())
    before = planner.graph_pool_idle_bytes(device)
    assert planner.graph_pool_idle_bytes(device) == before  # nothing happened: the kept answer
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        scratch = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
        scratch.fill_(1)
        del scratch
    pool = tuple(graph.pool())
    assert planner.graph_pool_idle_bytes(device).get(pool, 0) >= 64 * 2**20
    planner._pool_snapshots.clear()
    fresh = planner.graph_pool_idle_bytes(device)
    assert planner.graph_pool_idle_bytes(device) == fresh  # kept and fresh agree
    del graph
    torch.cuda.empty_cache()
    assert pool not in planner.graph_pool_idle_bytes(device)


def test_an_encode_that_runs_out_of_memory_is_retried_after_releasing_the_caches(monkeypatch):
    """bench_e2e at 24 GB (bf16): the text-to-image encode after a 4-reference edit ran out of memory beside the
    edit's idle caches and graphs; encode now gets sampling's retry (caches released, a fifth less budget)."""
    from qwen21_nodes.nodes.model import Qwen21Model

    calls = []
    attempts = iter([torch.OutOfMemoryError("CUDA out of memory"), "conditioning"])

    def encode(**kwargs):
        calls.append(("encode", kwargs["prompt"]))
        outcome = next(attempts)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    handle = Qwen21Model.__new__(Qwen21Model)
    handle.device = torch.device("cpu")
    handle.offload_text_encoder = "never"
    idle = types.SimpleNamespace(load=lambda *a: calls.append("load"), unload=lambda: None)
    handle.vae = handle.text_encoder = idle
    text_encoder = types.SimpleNamespace(estimated_tokens=lambda prompt, images, resolution: 10,
                                         activation_bytes=lambda tokens: tokens * 1000)  # fmt: skip
    handle.pipe = types.SimpleNamespace(encode=encode, release=lambda: calls.append("release"), vram_budget=None,
                                        text_encoder=text_encoder, text_encoder_device=handle.device)  # fmt: skip
    monkeypatch.setattr(memory_adapter, "LOCAL", LocalMemoryManager())
    assert handle.encode(prompt="a cat", images=[]) == "conditioning"
    assert calls == ["load", "load", ("encode", "a cat"), "release", "load", "load", ("encode", "a cat")]


def test_out_of_memory_is_retried_once_with_less_memory_then_named(monkeypatch):
    from qwen21_nodes.nodes.model import Qwen21Model

    handle = Qwen21Model.__new__(Qwen21Model)
    handle.device = torch.device("cpu")
    handle.pipe = types.SimpleNamespace(release=lambda: calls.append("release"), vram_budget=None)
    monkeypatch.setattr(memory_adapter, "LOCAL", LocalMemoryManager())
    memory_adapter.LOCAL.budget = 10 * GIB
    calls, budgets = [], []

    def flaky(failures):
        def run():
            budgets.append(memory_adapter.LOCAL.budget)
            if len(budgets) <= failures:
                raise torch.OutOfMemoryError("CUDA out of memory")
            return "latents"

        return run

    assert handle._retry_out_of_memory(flaky(1), "sampling", GIB) == "latents"
    assert budgets == [10 * GIB, 8 * GIB] and calls == ["release"] and memory_adapter.LOCAL.budget == 10 * GIB
    budgets.clear()
    with pytest.raises(MemoryError, match="also after a retry.*kv_cache fp8.*weight_dtype fp8 or int8"):
        handle._retry_out_of_memory(flaky(2), "sampling 1024x1024", GIB)
    assert memory_adapter.LOCAL.budget == 10 * GIB  # restored either way


def test_released_host_kv_buffers_are_kept_for_the_next_host_cache(monkeypatch):
    """Pinning a 4-reference edit's host K/V took 7.55 s at a 12 GB cap (H200): a released host cache's buffer is
    kept for the next one that fits (for K/V caches only), the largest two, none unless RAM has as much again. A new
    buffer has HEADROOM more, so the next edit's prompt may be a little longer (a 12 GB session pinned again for one
    more token)."""
    from qwen21_nodes.qwen21_core.dit import kv_cache
    from qwen21_nodes.qwen21_core.memory import pinned_buffers

    buffers = pinned_buffers.PinnedBuffers()
    monkeypatch.setattr(kv_cache, "HOST_KV_BUFFERS", buffers)

    def pinned(tokens):  # the bytes a host cache of `tokens` prefix tokens pins: its size plus the headroom
        nbytes = tokens * 2 * 2 * 8 * 4 * 2
        return nbytes + int(nbytes * pinned_buffers.HEADROOM)

    first = PrefixKVCache(2, 1, 50, 7, 2, 8, torch.float32, "cpu", placement="cpu")
    address = first._storage.data_ptr()
    first.release()
    assert buffers.kept_bytes == pinned(50)
    longer_prompt = PrefixKVCache(2, 1, 51, 7, 2, 8, torch.float32, "cpu", placement="cpu")  # fits the headroom
    assert longer_prompt._storage.data_ptr() == address and buffers.reused == 1 and buffers.kept_bytes == 0
    longer_prompt.release()
    smaller = PrefixKVCache(2, 1, 40, 7, 2, 8, torch.float32, "cpu", placement="cpu")
    assert smaller._storage.data_ptr() == address and buffers.reused == 2 and buffers.kept_bytes == 0
    larger = PrefixKVCache(2, 1, 60, 7, 2, 8, torch.float32, "cpu", placement="cpu")  # nothing kept: a new one
    assert larger._storage.data_ptr() != address
    on_gpu = PrefixKVCache(2, 1, 60, 7, 2, 8, torch.float32, "cpu", placement="gpu")
    for cache in (smaller, larger, on_gpu):
        cache.release()
    assert buffers.kept_bytes == pinned(50) + pinned(60)  # the two host ones, whole; the device cache's not
    buffers.give_back(torch.empty(10, dtype=torch.uint8))  # a third, smaller: the two largest stay
    assert buffers.kept_bytes == pinned(50) + pinned(60)
    monkeypatch.setattr(pinned_buffers, "host_free_bytes", lambda: 9)  # less RAM available than the buffer: none kept
    buffers.give_back(torch.empty(10, dtype=torch.uint8))
    assert buffers.kept_bytes == 0
    buffers.give_back(torch.empty(10, dtype=torch.uint8))
    buffers.clear()
    assert buffers.kept_bytes == 0


def test_the_dits_unloading_keeps_what_does_not_depend_on_its_place_and_a_retry_drops_all(monkeypatch):
    """At a 12 GB cap the DiT leaves the GPU for every encode, and the memory manager runs its unload callback. That
    frees what reads the DiT's weights by address (the decode and prefill graphs, with their K/V buffers) but keeps
    the condition images seen before and the pinned K/V buffers kept for the next host cache: when it dropped them
    too, the H200 session's 12 GB edits never found a reference again and a 4-reference edit pinned its 8 GiB again.
    An out-of-memory retry's release still drops all of them."""
    from PIL import Image
    from qwen21_nodes.nodes.model import Qwen21Model
    from qwen21_nodes.qwen21_core import pipeline as pipeline_module
    from qwen21_nodes.qwen21_core.memory import pinned_buffers
    from qwen21_nodes.qwen21_core.reference_cache import ReferenceCache

    buffers = pinned_buffers.PinnedBuffers()
    monkeypatch.setattr(pipeline_module, "HOST_KV_BUFFERS", buffers)
    monkeypatch.setattr(memory_adapter, "LOCAL", LocalMemoryManager())
    pipe = pipeline_module.Qwen21Pipeline.__new__(pipeline_module.Qwen21Pipeline)  # only what releasing touches
    cleared = []
    pipe.decode_graphs = types.SimpleNamespace(entries={}, clear=lambda: cleared.append("graphs"))
    pipe.prefill_graphs = types.SimpleNamespace(entries={}, clear=lambda: cleared.append("prefill graphs"))
    pipe.workers = None
    pipe.references = ReferenceCache()
    pipe.references.prepare(Image.new("RGBA", (96, 64), (200, 30, 30, 255)), 64)
    buffers.give_back(torch.empty(16, dtype=torch.uint8))
    # the node handle registers the DiT with the memory manager; its unload is what a cap runs every prompt
    cpu = torch.device("cpu")
    node_pipe = types.SimpleNamespace(
        transformer=torch.nn.Linear(2, 2), text_encoder=types.SimpleNamespace(model=torch.nn.Linear(2, 2)),
        vae=torch.nn.Linear(2, 2), sources={}, device=cpu, text_encoder_device=cpu, vae_execution_device=cpu,
        release_device_caches=pipe.release_device_caches, release=pipe.release,
    )  # fmt: skip
    handle = Qwen21Model(node_pipe, offload_text_encoder="auto")
    handle.transformer.released()  # what the memory manager runs once it moved the DiT off
    assert cleared == ["graphs", "prefill graphs"]
    assert len(pipe.references._entries) == 1 and buffers.kept_bytes == 16
    pipe.release()  # an out-of-memory retry
    assert cleared == ["graphs", "prefill graphs"] * 2 and not pipe.references._entries and buffers.kept_bytes == 0


@pytest.mark.gpu
@gpu
def test_on_the_gpu_a_second_host_kv_cache_reuses_the_pinned_buffer_and_reads_what_it_wrote():
    from qwen21_nodes.qwen21_core.dit import kv_cache
    from qwen21_nodes.qwen21_core.memory import pinned_buffers

    buffers = pinned_buffers.PinnedBuffers()
    original = kv_cache.HOST_KV_BUFFERS
    kv_cache.HOST_KV_BUFFERS = buffers
    try:
        first = PrefixKVCache(2, 1, 64, 16, 2, 8, torch.bfloat16, "cuda", placement="cpu")
        assert first._storage.is_pinned()
        address = first._storage.data_ptr()
        first.release()
        again = PrefixKVCache(2, 1, 48, 16, 2, 8, torch.bfloat16, "cuda", placement="cpu")
        assert again._storage.is_pinned() and again._storage.data_ptr() == address and buffers.reused == 1
        k, v = again.prefill_targets(0)
        k.fill_(1.5), v.fill_(-2.0)
        again.store_prefix(0)
        torch.cuda.synchronize()
        (stored_k, _, _), (stored_v, _, _) = again._parts(again._storage[0])
        assert bool((stored_k == 1.5).all()) and bool((stored_v == -2.0).all())
        again.release()
    finally:
        kv_cache.HOST_KV_BUFFERS = original


def test_a_decode_inside_comfyui_asks_for_its_untiled_pass_and_no_more_than_the_card_holds(monkeypatch):
    """Inside ComfyUI a VAE decode asks for the untiled pass's room (ComfyUI then partly unloads idle models, as for
    its own VAE Decode): the batch's pass where the card holds it, else one image's, else nothing (the pass tiles and
    nothing is evicted for it). Outside ComfyUI, and for a VAE on the CPU, it asks for nothing."""
    gib = 2**30
    monkeypatch.setattr(memory_adapter, "device_capacity_bytes", lambda device: 16 * gib)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(host, "IN_COMFYUI", False)
    assert memory_adapter.working_memory_request([3 * gib], cuda, gib) == 0
    monkeypatch.setattr(host, "IN_COMFYUI", True)
    assert memory_adapter.working_memory_request([3 * gib, gib], cuda, gib) == 3 * gib
    assert memory_adapter.working_memory_request([20 * gib, 3 * gib], cuda, gib) == 3 * gib
    assert memory_adapter.working_memory_request([20 * gib, 15 * gib + 1], cuda, gib) == 0
    assert memory_adapter.working_memory_request([3 * gib], torch.device("cpu"), gib) == 0


def test_the_handles_decode_loads_the_vae_with_the_request(monkeypatch):
    """Qwen21Model.decode passes the request for its latents (the batch's pass, then one image's) to the VAE's load;
    tiling "on" asks for nothing."""
    from qwen21_nodes.nodes.model import Qwen21Model

    loads, asked = [], []
    handle = object.__new__(Qwen21Model)
    vae = types.SimpleNamespace(untiled_decode_bytes=lambda shape, precision, quality: shape[0] * 1000 + (
        quality == "fast"))  # fmt: skip
    handle.pipe = types.SimpleNamespace(vae=vae, vae_execution_device=torch.device("cuda", 0),
                                        decode=lambda latents, **kwargs: "images")  # fmt: skip
    handle.vae = types.SimpleNamespace(full_bytes=7, load=loads.append)

    def request(candidates, device, weights_bytes):
        asked.append((candidates, device, weights_bytes))
        return candidates[-1]

    monkeypatch.setattr(memory_adapter, "working_memory_request", request)
    latents = torch.zeros(3, 4, 2, 2)
    assert handle.decode(latents, tiling="auto", quality="fast") == "images"
    assert asked == [([3001, 1001], torch.device("cuda", 0), 7)] and loads == [1001]
    handle.decode(latents, tiling="on")
    assert loads == [1001, 0] and len(asked) == 1
