"""Where the text encoder lives (qwen21_core/memory/manager.py): it stays on the GPU while the run fits beside it,
leaves when the DiT needs the room, never leaves under "never", always leaves under "always"; older workflows'
boolean keeps its meaning; inside ComfyUI our nodes leave the eviction to ComfyUI's memory manager. Plus the host
copy the weights move to and from (memory/host_copy.py): made once, refreshed only when the weights changed."""

from __future__ import annotations

import types

import pytest
import torch
from qwen21_nodes.nodes import host, memory_adapter
from qwen21_nodes.nodes.loader import Qwen21DiffusersLoader, Qwen21ModelLoader
from qwen21_nodes.qwen21_core.memory import manager as memory_manager
from qwen21_nodes.qwen21_core.memory import planner
from qwen21_nodes.qwen21_core.memory.manager import LocalMemoryManager, text_encoder_offload

GIB = 2**30


class Stack:
    """A streamable stand-in on a pretend GPU: records its placements, reports what it holds there."""

    def __init__(self, layers=8, layer_bytes=GIB, fixed=GIB):
        self.num_layers, self.layer_bytes, self.fixed = layers, layer_bytes, fixed
        self.placed: list[tuple[str, int | None]] = []

    def place(self, device, resident_layers=None):
        self.placed.append((torch.device(device).type, resident_layers))

    @property
    def on_gpu(self) -> bool:
        return bool(self.placed) and self.placed[-1][0] == "cuda"

    def device_weight_bytes(self):
        if not self.on_gpu:
            return 0
        resident = self.placed[-1][1]
        return self.fixed + (self.num_layers if resident is None else resident) * self.layer_bytes


@pytest.fixture
def gpu(monkeypatch):
    """A pretend 24 GiB GPU: free memory is 24 GiB less what the stacks hold there."""
    stacks: list[Stack] = []

    def free(device, budget=None):
        return 24 * GIB - sum(s.device_weight_bytes() for s in stacks)

    monkeypatch.setattr(planner, "device_free_bytes", free)
    local = LocalMemoryManager()
    monkeypatch.setattr(memory_adapter, "LOCAL", local)

    def managed(name, layers, evictable=True, device="cuda"):
        stack = Stack(layers=layers)
        stacks.append(stack)
        m = memory_adapter.ManagedModules({name: torch.nn.Linear(1, 1)}, torch.device(device), streamable=stack)
        m.full_bytes = stack.fixed + layers * stack.layer_bytes
        m.device_bytes = stack.device_weight_bytes
        m.evictable = evictable
        return m, stack

    return managed


def test_the_encoder_stays_when_sampling_fits_beside_it(gpu):
    encoder, encoder_stack = gpu("text_encoder", 8)  # 9 GiB
    dit, dit_stack = gpu("transformer", 6)  # 7 GiB
    memory_adapter.LOCAL.load(encoder, GIB)
    memory_adapter.LOCAL.load(dit, 2 * GIB)  # 9 + 7 + 2 + 0.5 headroom <= 24
    assert encoder_stack.placed == [("cuda", None)] and dit_stack.placed == [("cuda", None)]
    memory_adapter.LOCAL.load(encoder, GIB)  # the next prompt: already there, nothing moves (or is even walked over)
    assert encoder_stack.placed == [("cuda", None)]


def test_the_encoder_leaves_when_the_dit_needs_the_room(gpu):
    encoder, encoder_stack = gpu("text_encoder", 8)  # 9 GiB
    dit, dit_stack = gpu("transformer", 12)  # 13 GiB
    memory_adapter.LOCAL.load(encoder, GIB)
    memory_adapter.LOCAL.load(dit, 4 * GIB)  # 9 + 13 + 4 + 0.5 > 24: the encoder makes room, the DiT stays whole
    assert encoder_stack.placed[-1] == ("cpu", None) and dit_stack.placed[-1] == ("cuda", None)
    memory_adapter.LOCAL.load(encoder, GIB)  # the next prompt: it comes back beside the DiT (24 - 13 - 1 - 0.5 >= 9)
    assert encoder_stack.placed[-1] == ("cuda", None) and dit_stack.placed[-1] == ("cuda", None)
    memory_adapter.LOCAL.load(encoder, 3 * GIB)  # an encode with 4 references: the DiT (least recently used) makes room
    assert encoder_stack.placed[-1] == ("cuda", None) and dit_stack.placed[-1] == ("cpu", None)


def test_an_indexed_and_a_bare_name_of_one_gpu_are_the_same_device_for_eviction(gpu):
    """The text encoder's device comes from its weights ("cuda:0"), a handle's may be given as "cuda": the manager
    must still see one GPU, or the encoder never makes room and the DiT streams nearly all its blocks (the H200
    session at a 12 GB cap: 2 of 32 blocks resident, then errors for want of room)."""
    encoder, encoder_stack = gpu("text_encoder", 8, device="cuda:0")
    dit, dit_stack = gpu("transformer", 12)  # "cuda"
    memory_adapter.LOCAL.load(encoder, GIB)
    memory_adapter.LOCAL.load(dit, 4 * GIB)
    assert encoder_stack.placed[-1] == ("cpu", None) and dit_stack.placed[-1] == ("cuda", None)


def test_devices_compare_by_their_gpu_not_their_spelling():
    assert planner.same_device("cuda:0", torch.device("cuda", 0)) and not planner.same_device("cuda:0", "cpu")
    assert not planner.same_device("cuda:0", "cuda:1") and planner.same_device("cpu", torch.device("cpu"))
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    assert planner.same_device("cuda", f"cuda:{current}") and not planner.same_device("cuda", f"cuda:{current + 1}")


def test_never_keeps_the_encoder_and_the_dit_streams_instead(gpu):
    encoder, encoder_stack = gpu("text_encoder", 8, evictable=False)
    dit, dit_stack = gpu("transformer", 12)
    memory_adapter.LOCAL.load(encoder, GIB)
    memory_adapter.LOCAL.load(dit, 4 * GIB)
    assert encoder_stack.placed == [("cuda", None)]  # not evicted
    # 24 - 9 held + 0 own - 4 needed - 0.5 = 10.5 GiB for the DiT: fixed 1 + two 1 GiB staging slots, 7 layers
    assert dit_stack.placed[-1] == ("cuda", 7)


def test_a_control_branch_is_placed_with_the_dit_and_never_evicted_for_it(gpu):
    """A controlled run places the Fun-Control branch first, leaving the DiT's room where the card has it; the DiT's
    own placement may evict the text encoder but never the branch it runs with (on a small card both stream)."""
    encoder, encoder_stack = gpu("text_encoder", 8)  # 9 GiB
    dit, dit_stack = gpu("transformer", 8)  # 9 GiB
    control, control_stack = gpu("fun_control", 4)  # 5 GiB
    memory_adapter.LOCAL.load(encoder, GIB)
    dit.load(2 * GIB, companions=(control,))  # 9 + 9 + 5 + 2 + 0.5 > 24: the encoder leaves, both stay whole
    assert encoder_stack.placed[-1] == ("cpu", None)
    assert control_stack.placed[-1] == ("cuda", None) and dit_stack.placed[-1] == ("cuda", None)
    assert control.evictable  # the DiT's load borrowed it, then gave it back


def test_on_a_small_card_the_branch_streams_so_that_the_dit_stays_whole(gpu, monkeypatch):
    """The branch is placed first with the DiT's whole room kept: on a 12 GiB card it streams its blocks (16 a step
    against the DiT's 32, the cheaper stack to stream) and the DiT stays whole; the DiT's load does not move it."""
    monkeypatch.setattr(planner, "device_free_bytes", lambda device, budget=None: 12 * GIB - sum(
        s.device_weight_bytes() for s in stacks))  # fmt: skip
    dit, dit_stack = gpu("transformer", 8)  # 9 GiB
    control, control_stack = gpu("fun_control", 4)  # 5 GiB
    stacks = [dit_stack, control_stack]
    dit.load(GIB, companions=(control,))
    # the branch: 12 - (1 needed + 9 for the DiT) - 0.5 = 1.5 GiB, less than its fixed part and two staging slots
    assert control_stack.placed == [("cuda", 0)]
    assert dit_stack.placed == [("cuda", None)]  # 12 - 1 (the branch's fixed part) - 1 - 0.5 = 9.5 GiB >= 9


def test_choices_and_older_workflows_boolean():
    assert [text_encoder_offload(v) for v in ("auto", "always", "never", True, False)] == [
        "auto", "always", "never", "always", "never"]  # fmt: skip
    with pytest.raises(ValueError, match="offload_text_encoder must be one of"):
        text_encoder_offload("sometimes")
    for loader in (Qwen21ModelLoader, Qwen21DiffusersLoader):
        assert loader.INPUT_TYPES()["required"]["offload_text_encoder"][1]["default"] == "auto"
        assert loader.VALIDATE_INPUTS(offload_text_encoder=True) is True
        assert loader.VALIDATE_INPUTS(offload_text_encoder="never") is True
        assert "must be one of" in loader.VALIDATE_INPUTS(offload_text_encoder="sometimes")


def _handle(monkeypatch, choice):
    from qwen21_nodes.nodes.model import Qwen21Model

    text = types.SimpleNamespace(model=torch.nn.Linear(2, 2), estimated_tokens=lambda *a: 10,
                                 activation_bytes=lambda tokens: tokens * 100)  # fmt: skip
    pipe = types.SimpleNamespace(transformer=torch.nn.Linear(2, 2), text_encoder=text, vae=torch.nn.Linear(2, 2),
                                 sources={}, release_device_caches=lambda: None, device=torch.device("cpu"),
                                 text_encoder_device=torch.device("cpu"), vae_execution_device=torch.device("cpu"),
                                 encode=lambda **kwargs: "conditioning")  # fmt: skip
    handle = Qwen21Model(pipe, offload_text_encoder=choice)
    events = []
    monkeypatch.setattr(handle.text_encoder, "load", lambda required=0: events.append(("load", required)))
    monkeypatch.setattr(handle.text_encoder, "unload", lambda: events.append(("unload",)))
    monkeypatch.setattr(handle.vae, "load", lambda required=0: None)
    return handle, events


@pytest.mark.parametrize("choice, leaves", [("auto", False), ("never", False), ("always", True), (True, True)])
def test_an_encode_unloads_the_encoder_only_when_asked_to_always(monkeypatch, choice, leaves):
    handle, events = _handle(monkeypatch, choice)
    assert handle.encode(prompt="a cat") == "conditioning"
    assert events == [("load", 1000)] + ([("unload",)] if leaves else [])
    assert handle.text_encoder.evictable == (text_encoder_offload(choice) != "never")
    assert handle.pipe.memory.places_weights is False  # a memory manager places the weights, not the pipeline
    assert handle.pipe.memory is memory_adapter.LOCAL  # and owns the one budget (--vram-budget) outside ComfyUI


def test_inside_comfyui_the_encoder_is_a_model_comfyui_may_unload(monkeypatch):
    """With "auto" our nodes never unload the encoder themselves: it is registered with ComfyUI's memory manager
    (load_models_gpu), which moves it off when the DiT asks for more room than is free."""
    loaded, unloaded = [], []

    fake_mm = types.SimpleNamespace(
        load_models_gpu=lambda models, memory_required, force_full_load: loaded.append((models[0], memory_required)),
        current_loaded_models=[],
        soft_empty_cache=lambda: None,
    )  # fmt: skip
    monkeypatch.setattr(host, "IN_COMFYUI", True)
    monkeypatch.setattr(host, "comfy_mm", fake_mm)
    monkeypatch.setattr(host, "offload_device", lambda: torch.device("cpu"))
    monkeypatch.setattr(memory_adapter, "_new_patcher", lambda make_model, managed, *devices: types.SimpleNamespace(
        name=managed.name))  # fmt: skip
    from qwen21_nodes.nodes.model import Qwen21Model

    text = types.SimpleNamespace(model=torch.nn.Linear(2, 2), estimated_tokens=lambda *a: 10,
                                 activation_bytes=lambda tokens: 4096)  # fmt: skip
    pipe = types.SimpleNamespace(transformer=torch.nn.Linear(2, 2), text_encoder=text, vae=torch.nn.Linear(2, 2),
                                 sources={}, release_device_caches=lambda: None, device=torch.device("cpu"),
                                 text_encoder_device=torch.device("cpu"), vae_execution_device=torch.device("cpu"),
                                 encode=lambda **kwargs: "conditioning")  # fmt: skip
    handle = Qwen21Model(pipe, offload_text_encoder="auto")
    handle.text_encoder.unload = lambda: unloaded.append("text_encoder")
    handle.encode(prompt="a cat")
    assert (handle.text_encoder.patcher, 4096) in loaded and unloaded == []


@pytest.mark.parametrize(
    "on_device,free,needed,margin,expected",
    [(3 * GIB, 4 * GIB, GIB, GIB, True), (3 * GIB, 2 * GIB, GIB, GIB, True), (3 * GIB, 2 * GIB - 1, GIB, GIB, False),
     (0, 40 * GIB, GIB, GIB, False)],
)  # fmt: skip
def test_the_encoder_runs_in_place_with_part_of_it_on_the_device_and_room_for_its_activations(
    on_device, free, needed, margin, expected
):
    assert memory_manager.encoder_runs_in_place(on_device, free, needed, margin) is expected


def _comfy_managed(monkeypatch, on_device: int, free: int, runs_in_place=True, device="cuda"):
    """A ManagedModules as inside ComfyUI on a pretend GPU (its patcher a stand-in): `on_device` bytes of it placed,
    `free` bytes free by ComfyUI's count; returns it and the manager's load calls."""
    calls = []
    fake_mm = types.SimpleNamespace(
        load_models_gpu=lambda models, memory_required, force_full_load: calls.append((models, memory_required)),
        get_free_memory=lambda device: free,
        minimum_inference_memory=lambda: GIB,
    )  # fmt: skip
    monkeypatch.setattr(host, "comfy_mm", fake_mm)
    m = memory_adapter.ManagedModules({"text_encoder": torch.nn.Linear(1, 1)}, torch.device(device),
                                      streamable=Stack(layers=36))  # fmt: skip
    m.patcher = types.SimpleNamespace(name="te")  # built outside ComfyUI, then given a patcher as inside it
    m.device_bytes = lambda: on_device
    m.runs_in_place = runs_in_place
    return m, calls


def test_inside_comfyui_a_partly_loaded_encoder_runs_where_it_is(monkeypatch):
    """A changed prompt on a card that cannot hold the DiT and the encoder together: the encoder, partly on the GPU
    after sampling took its room, encodes there (its other layers streaming) instead of asking ComfyUI to load it
    whole, which evicted the DiT's blocks for it and made sampling load them back."""
    m, calls = _comfy_managed(monkeypatch, on_device=6 * GIB, free=3 * GIB)
    m.load(GIB // 2)
    assert calls == []


@pytest.mark.parametrize(
    "on_device,free,runs_in_place,device",
    [(0, 40 * GIB, True, "cuda"), (6 * GIB, GIB, True, "cuda"), (6 * GIB, 40 * GIB, False, "cuda"),
     (6 * GIB, 40 * GIB, True, "cpu")],
    ids=["nothing-placed-yet", "no-room-for-activations", "the-dit", "not-a-gpu"],
)  # fmt: skip
def test_otherwise_comfyuis_manager_places_it(monkeypatch, on_device, free, runs_in_place, device):
    m, calls = _comfy_managed(monkeypatch, on_device, free, runs_in_place, device)
    m.load(GIB // 2)
    assert calls == [([m.patcher], GIB // 2)]


def test_the_handles_encoder_runs_in_place_and_its_dit_does_not(monkeypatch):
    monkeypatch.setattr(host, "IN_COMFYUI", False)
    from qwen21_nodes.nodes.model import Qwen21Model

    text = types.SimpleNamespace(model=torch.nn.Linear(2, 2))
    cpu = torch.device("cpu")
    pipe = types.SimpleNamespace(transformer=torch.nn.Linear(2, 2), text_encoder=text, vae=torch.nn.Linear(2, 2),
                                 sources={}, release_device_caches=lambda: None, device=cpu,
                                 text_encoder_device=cpu, vae_execution_device=cpu)  # fmt: skip
    handle = Qwen21Model(pipe)
    assert handle.text_encoder.runs_in_place and not handle.transformer.runs_in_place
    assert not handle.vae.runs_in_place


# ---- the host copy ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_offload_and_reload_go_through_one_pinned_host_copy_refreshed_only_after_a_change():
    from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer
    from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER

    torch.manual_seed(0)
    dit = QwenImage21Transformer(TINY_TRANSFORMER).to("cuda", torch.bfloat16)
    want = {name: p.detach().clone() for name, p in dit.named_parameters()}
    dit.place("cpu")
    home = dit.host_copy
    assert all(flat.is_pinned() for flat in home.flats.values())
    assert all(p.device.type == "cpu" for p in dit.parameters())
    buffers = {i: f.data_ptr() for i, f in home.flats.items()}
    dit.place("cuda")
    assert all(p.device.type == "cuda" for p in dit.parameters())
    assert all(torch.equal(p, want[name]) for name, p in dit.named_parameters())
    # a LoRA merge changes the weights on the GPU and names them: the next offload refreshes the host copy
    with torch.no_grad():
        dit.transformer_blocks[0].attn.to_out.weight.add_(1)
    dit.weights_id = ("a LoRA",)
    dit.place("cpu")
    assert {i: f.data_ptr() for i, f in home.flats.items()} == buffers  # the same buffers, refreshed in place
    dit.place("cuda")
    changed = "transformer_blocks.0.attn.to_out.weight"
    assert torch.equal(dit.get_parameter(changed), want[changed] + 1)
    dit.place("cuda", 1)  # streaming from the same host copy
    assert dit.streamer.host[1].data_ptr() == buffers[1]


def test_manager_is_the_only_eviction_policy():
    """The nodes hold no policy of their own: the adapter's local manager is memory/manager.py's, and the ComfyUI
    services module holds no memory code at all."""
    assert type(memory_adapter.LOCAL) is memory_manager.LocalMemoryManager
    assert not any(hasattr(host, name) for name in ("plan_sampling", "LOCAL", "ManagedModules", "LocalMemoryManager"))


def test_the_runner_accepts_an_older_workflows_boolean_and_names_a_bad_choice(tmp_path):
    import json

    from qwen21_nodes.runner.cli import WORKFLOWS_DIR, node_classes
    from qwen21_nodes.runner.graph import WorkflowError, validate

    prompt = json.loads((WORKFLOWS_DIR / "api" / "text_to_image.json").read_text())
    loader = next(node for node in prompt.values() if node["class_type"] == "Qwen21ModelLoader")
    assert loader["inputs"]["offload_text_encoder"] == "auto"  # what the shipped workflows say now
    classes = node_classes(str(tmp_path), str(tmp_path))

    def problems(value):
        loader["inputs"]["offload_text_encoder"] = value
        try:
            validate(prompt, classes)
        except WorkflowError as error:  # no model files here: those inputs are reported too
            return [p for p in error.problems if "offload_text_encoder" in p]
        return []

    assert problems(True) == [] and problems(False) == [] and problems("never") == []  # as saved before, and now
    (bad,) = problems("sometimes")
    assert "must be one of ['auto', 'always', 'never']" in bad


# ---- where the loader reads the text encoder to -------------------------------------------------------------


def test_the_encoder_is_read_to_the_cpu_only_when_it_does_not_fit_beside_the_dit(monkeypatch):
    from qwen21_nodes.qwen21_core.memory import manager

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    budgets = []

    def free(device, budget=None):
        budgets.append(budget)
        return 29 * GIB

    monkeypatch.setattr(planner, "device_free_bytes", free)
    assert manager.text_encoder_load_device(gpu, gpu, 9 * GIB, 8 * GIB) == gpu  # 29 - 9 >= 8 x 1.25 + 0.5
    assert manager.text_encoder_load_device(gpu, gpu, 19 * GIB, 8 * GIB) == cpu  # 29 - 19 < 10.5
    assert manager.text_encoder_load_device(gpu, torch.device("cuda", 1), 19 * GIB, 8 * GIB).index == 1  # its own
    assert manager.text_encoder_load_device(gpu, gpu, 9 * GIB, 8 * GIB, budget=12 * GIB) == gpu
    assert budgets[-1] == 12 * GIB  # the one budget (--vram-budget) is what the free memory is read under
    assert manager.text_encoder_load_device(cpu, cpu, 0, 8 * GIB) == cpu


@pytest.mark.parametrize("choice", ["auto", "none", "fp8"])
def test_loaded_sizes_are_estimated_from_the_file_headers(tmp_path, choice):
    """The estimate the loader decides with, against what loading really puts in memory (fp32 on the CPU; fp8 makes
    the block / decoder Linears 1 byte a value)."""
    from qwen21_nodes.qwen21_core.checkpoints.loading import estimated_loaded_bytes, load_components
    from qwen21_nodes.qwen21_core.quant.plan import WeightFormats
    from qwen21_nodes.qwen21_core.tiny import make_tiny

    paths = make_tiny(tmp_path)
    source = {name: paths[name] for name in ("transformer", "vae", "text_encoder", "tokenizer")}
    parts = load_components(source, "cpu", torch.float32, weight_formats=WeightFormats(dit=choice, text_encoder=choice))

    def loaded(module):
        return sum(t.numel() * t.element_size() for t in module.parameters())

    for component, module in (("transformer", parts.transformer), ("text_encoder", parts.text_encoder.model)):
        estimate = estimated_loaded_bytes(paths[component], component, choice, torch.float32)
        assert abs(estimate - loaded(module)) <= 0.05 * loaded(module), (component, estimate, loaded(module))


def test_the_loader_reads_the_encoder_to_the_cpu_on_a_card_too_small_for_both(monkeypatch, tmp_path):
    """On a pretend 12 GB card with 8 GiB free after the DiT, the loader asks for the encoder to be read to the CPU
    while it still runs on the GPU (the memory manager places it at the first encode); with room, on the GPU."""
    from qwen21_nodes.nodes import loader
    from qwen21_nodes.qwen21_core.memory import manager
    from qwen21_nodes.qwen21_core.tiny import make_tiny

    paths = make_tiny(tmp_path)
    source = {name: paths[name] for name in ("transformer", "vae", "text_encoder", "tokenizer")}
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(loader, "estimated_loaded_bytes", lambda path, component, choice, dtype: {
        "transformer": 7 * GIB, "text_encoder": 9 * GIB}[component])  # fmt: skip
    sizes = loader._loaded_sizes(source, loader.WeightFormats("fp8", "fp8"), torch.bfloat16)
    assert sizes == (7 * GIB, 9 * GIB)
    for free, where in ((12 * GIB, torch.device("cpu")), (40 * GIB, gpu)):
        monkeypatch.setattr(planner, "device_free_bytes", lambda device, budget=None, free=free: free)
        assert manager.text_encoder_load_device(gpu, gpu, *sizes) == where
    # an encoder on a GPU of its own counts only that GPU's room
    monkeypatch.setattr(planner, "device_free_bytes", lambda device, budget=None: 12 * GIB)
    other = torch.device("cuda", 1)
    assert manager.text_encoder_load_device(gpu, other, *sizes) == other
