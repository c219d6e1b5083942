"""The door's patcher (nodes/comfy/patcher.py) against ComfyUI's ModelPatcher API as both supported versions have it.

- The signatures of every method the door overrides, written down here as ComfyUI 0.3.64 (a125cd84, the runnable
  snapshot) and the newest ComfyUI read (08d0e510, with dynamic VRAM) declare them: each override accepts every
  call each version can make, positionally and by keyword.
- The door driven the newer way: a stand-in of the newest ModelPatcher and LoadedModel (tests/comfy_standin.py)
  loads, partly unloads, clones and detaches it; the books ComfyUI reads stay right, object patches of one clone do
  not reach another, a LoRA'd clone merges without moving the weights off the device.
With COMFYUI_DIR set, the 0.3.64 signatures are also checked against that checkout's source.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
from pathlib import Path

import comfy_standin
import pytest
import torch

COMMIT_0_3_64 = "a125cd84b054a57729b5eecab930ca9408719832"
SIGNATURES = {
    f"0.3.64 ({COMMIT_0_3_64[:8]})": {
        "clone": "(self)",
        "add_patches": "(self, patches, strength_patch=1.0, strength_model=1.0)",
        "load": "(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False)",
        "partially_load": "(self, device_to, extra_memory=0, force_patch_weights=False)",
        "partially_unload": "(self, device_to, memory_to_free=0)",
        "unpatch_model": "(self, device_to=None, unpatch_weights=True)",
        "model_size": "(self)",
    },
    f"newest ({comfy_standin.NEWEST_COMMIT[:8]})": {
        "clone": "(self, disable_dynamic=False, model_override=None, force_deepcopy=False)",
        "add_patches": "(self, patches, strength_patch=1.0, strength_model=1.0)",
        "load": "(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False)",
        "partially_load": "(self, device_to, extra_memory=0, force_patch_weights=False)",
        "partially_unload": "(self, device_to, memory_to_free=0, force_patch_weights=False)",
        "unpatch_model": "(self, device_to=None, unpatch_weights=True)",
        "model_size": "(self)",
        "is_dynamic": "(self)",
    },
}
MB = 100  # the fake stack: 10 layers of 100 bytes and 200 bytes of other weights


@pytest.fixture
def door():
    """nodes/comfy/patcher.py imported against the stand-in of the newest comfy modules (removed afterwards)."""
    names = ("qwen21_nodes.nodes.comfy.patcher", "qwen21_nodes.nodes.comfy.sampling")
    saved = {name: sys.modules.pop(name) for name in (*names, "comfy", "comfy.model_patcher",
                                                      "comfy.patcher_extension") if name in sys.modules}  # fmt: skip
    modules = comfy_standin.install()
    try:
        yield importlib.import_module("qwen21_nodes.nodes.comfy.patcher")
    finally:
        for name in (*modules, *names):
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def _parameters(text: str) -> list[inspect.Parameter]:
    function = ast.parse(f"def f{text}: pass").body[0]
    args = function.args
    defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
    return [inspect.Parameter(a.arg, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                              default=inspect.Parameter.empty if d is None else ast.literal_eval(d))
            for a, d in zip(args.args, defaults, strict=True)]  # fmt: skip


@pytest.mark.parametrize("version", list(SIGNATURES))
def test_every_override_accepts_each_versions_calls(door, version):
    ours = door.Qwen21Patcher
    for name, text in SIGNATURES[version].items():
        method = ours.__dict__.get(name)
        if method is None:
            continue  # inherited: ComfyUI's own
        signature = inspect.signature(method)
        params = _parameters(text)[1:]
        values = [object() for _ in params]
        signature.bind(None, *values)  # every argument positionally
        signature.bind(None, **{p.name: v for p, v in zip(params, values, strict=True)})  # every one by keyword
        required = [p for p in params if p.default is inspect.Parameter.empty]
        signature.bind(None, *[object() for _ in required])  # the defaults left to the override


def test_the_standin_declares_the_newest_signatures():
    newest = SIGNATURES[f"newest ({comfy_standin.NEWEST_COMMIT[:8]})"]
    for name, text in newest.items():
        assert str(inspect.signature(getattr(comfy_standin.ModelPatcher, name))) == text, name


def test_comfyui_0_3_64_declares_the_signatures_written_here():
    comfyui = os.environ.get("COMFYUI_DIR", "")
    source = Path(comfyui, "comfy", "model_patcher.py")
    if not source.is_file():
        pytest.skip("set COMFYUI_DIR to a ComfyUI 0.3.64 checkout to check the written signatures against its source")
    tree = ast.parse(source.read_text())
    patcher = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "ModelPatcher")
    found = {f.name: f"({ast.unparse(f.args)})" for f in patcher.body if isinstance(f, ast.FunctionDef)}
    for name, text in SIGNATURES[f"0.3.64 ({COMMIT_0_3_64[:8]})"].items():
        assert found[name] == text, (name, found[name])


class _Managed:
    """What the patcher reads of our ManagedModules: a streamable stack of 10 layers, placements recorded."""

    class _Stack:
        num_layers, layer_bytes = 10, MB

    name, full_bytes, streamable = "transformer", 2 * MB + 10 * MB, _Stack()

    def __init__(self):
        self.placed: list[tuple[str, int | None]] = []
        self.unloads = 0

    def on_unload(self):
        self.unloads += 1

    def place(self, device, resident_layers=None):
        self.placed.append((str(device), resident_layers))

    def device_bytes(self):
        if not self.placed or self.placed[-1][0] != "cuda":
            return 0
        resident = self.placed[-1][1]
        return self.full_bytes if resident is None else 2 * MB + resident * MB + 2 * MB  # two staging slots

    def resident_for(self, budget):
        from qwen21_nodes.qwen21_core.memory.planner import resident_layers

        return resident_layers(budget, self.full_bytes, MB, 10)


class _Model(torch.nn.Module):
    LAYER = "transformer_blocks.0.attn.to_q"

    def __init__(self, managed):
        super().__init__()
        self.qwen21_managed = managed
        self.diffusion_model = torch.nn.Identity()
        self.model_sampling = "plain"
        self.merged: list[tuple] = []

    def state_dict(self, *args, **kwargs):
        return {f"diffusion_model.{self.LAYER}.weight": torch.empty(4, 4, device="meta")}

    def lora_slots(self):
        from qwen21_nodes.qwen21_core.lora.merge import LayerSlot

        return {self.LAYER: LayerSlot("transformer_blocks.0.attn.to_qkv.weight", slice(0, 4), (4, 4))}

    def apply_lora_stack(self, ours, patches, patches_uuid):
        self.merged.append((ours, sorted(patches), patches_uuid))


def test_the_door_driven_the_newer_way_keeps_comfyuis_books(door):
    managed = _Managed()
    model = _Model(managed)
    plain = door.new_patcher(model, managed, "cuda", "cpu")
    assert not plain.is_dynamic() and plain.model_size() == 12 * MB

    comfy_standin.LoadedModel(plain).model_load(0)  # 0: as much as it wants
    assert managed.placed == [("cuda", None)]
    assert model.model_loaded_weight_memory == 12 * MB and not model.model_lowvram
    assert model.current_weight_patches_uuid == plain.patches_uuid and model.device == "cuda"
    assert model.merged[-1] == ((), [], plain.patches_uuid)

    shifted = plain.clone(disable_dynamic=True, model_override=None)  # the newest clone's keywords
    shifted.add_object_patch("model_sampling", "shifted")
    comfy_standin.LoadedModel(shifted).model_load(0)
    assert model.model_sampling == "shifted" and managed.placed == [("cuda", None)]  # whole already: nothing moved
    comfy_standin.LoadedModel(plain).model_load(0)
    assert model.model_sampling == "plain"  # the clone's object patch undone before the plain MODEL runs

    lora = plain.clone()
    up, down = torch.randn(4, 2), torch.randn(2, 4)
    lora.add_patches({f"diffusion_model.{_Model.LAYER}.weight": ("lora", (up, down, 1.0, None, None, None))}, 0.5)
    comfy_standin.LoadedModel(lora).model_load(0)
    assert managed.placed == [("cuda", None)]  # another LoRA stack: merged in place, no unload and reload
    assert model.merged[-1][1] == [f"diffusion_model.{_Model.LAYER}.weight"]
    assert model.current_weight_patches_uuid == lora.patches_uuid
    comfy_standin.LoadedModel(plain).model_load(0)
    assert model.merged[-1] == ((), [], plain.patches_uuid) and managed.placed == [("cuda", None)]

    freed = plain.partially_load("cuda", -3 * MB, force_patch_weights=False)  # the newest manager may ask for less
    assert freed == 0 and managed.placed[-1] == ("cuda", 5) and model.model_loaded_weight_memory == 9 * MB
    assert model.model_lowvram
    assert comfy_standin.LoadedModel(plain).model_unload(memory_to_free=2 * MB) is False  # partly: enough freed
    assert managed.placed[-1] == ("cuda", 3) and model.model_loaded_weight_memory == 7 * MB
    assert comfy_standin.LoadedModel(plain).model_unload() is True  # all of it: detached
    assert managed.placed[-1] == ("cpu", None) and model.model_loaded_weight_memory == 0 and model.device == "cpu"
    assert model.current_weight_patches_uuid is None and managed.unloads == 1

    comfy_standin.LoadedModel(plain).model_load(5 * MB)  # back with a budget: 5 - 2 other - 2 slots = 1 layer
    assert managed.placed[-1] == ("cuda", 1) and model.model_lowvram


def test_a_lora_our_merge_cannot_take_is_refused_at_the_loader(door):
    managed = _Managed()
    model = _Model(managed)
    patcher = door.new_patcher(model, managed, "cuda", "cpu")
    key = f"diffusion_model.{_Model.LAYER}.weight"
    with pytest.raises(ValueError, match="do not share a rank"):
        patcher.clone().add_patches({key: ("lora", (torch.randn(4, 3), torch.randn(2, 4), None, None, None, None))})
    with pytest.raises(ValueError, match="matches no layer"):
        patcher.clone().add_patches({"lora_unet_down_blocks_0.weight": ("diff", (torch.zeros(4),))})
    with pytest.raises(ValueError, match="changes 1 biases"):
        patcher.clone().add_patches({f"diffusion_model.{_Model.LAYER}.bias": ("diff", (torch.zeros(4),)),
                                     key: ("diff", (torch.zeros(4, 4),))})  # fmt: skip
