"""The LoRA node and the model handle on the tiny checkpoint (CPU), and LoRAs with the prefix cache and decode graphs:
handles never change each other, alternating branches re-merge as needed, a kept prefix is never reused across LoRA
sets, and captured graphs stay valid (same addresses, no recapture, replay equals eager with the LoRA)."""

import json

import pytest
import torch
from dit_reference import our_dit, reference_dit
from qwen21_nodes.nodes import host
from qwen21_nodes.nodes.loader import Qwen21ModelLoader
from qwen21_nodes.nodes.lora import Qwen21LoraLoader
from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
from qwen21_nodes.qwen21_core.lora.merge import LoraMerger, MemoryOriginals, layer_shapes
from qwen21_nodes.qwen21_core.lora.reading import LoraError, read_lora
from qwen21_nodes.qwen21_core.request import SampleRequest
from qwen21_nodes.qwen21_core.sampler import Sampler
from qwen21_nodes.runner.cli import ensure_tiny_models
from qwen21_nodes.runner.ui_format import check_ui_workflow, ui_to_api
from safetensors.torch import load_file, save_file
from test_decode_graphs import Recorder, _layout, _prefilled
from test_lora import lora_state_dict, random_factors, write

TINY_LORA = "tiny_turbo_lora.safetensors"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models")


@pytest.fixture(scope="module")
def base(models_dir):
    host.set_models_dir(models_dir)
    loaded, *_ = Qwen21ModelLoader().load(
        host.list_weight_files("diffusion_models")[0], host.list_weight_files("text_encoders")[0],
        host.list_weight_files("vae")[0], weight_dtype="fp32", device="cpu", offload_text_encoder=True,
    )  # fmt: skip
    yield loaded
    host.set_models_dir(None)


def sample(handle, cond, seed=3):
    return handle.sample(cond, SampleRequest(height=64, width=64, steps=2, batch_size=1, true_cfg_scale=1.0, seed=seed))


def checkpoint_weights(models_dir):
    """The transformer's weights as stored in the tiny ComfyUI file, under our checkpoint names."""
    from qwen21_nodes.qwen21_core.checkpoints.key_maps import _dit_converter

    convert = _dit_converter("model.diffusion_model.")
    stored = load_file(next((models_dir / "diffusion_models").glob("*.safetensors")))
    return {name: t for key, tensor in stored.items() for name, t in convert(key, tensor)}


def test_node_lists_the_loras_folder_and_returns_a_new_handle(base):
    choices = Qwen21LoraLoader.INPUT_TYPES()["required"]["lora_name"][0]
    assert choices == [TINY_LORA]
    specs = {**Qwen21LoraLoader.INPUT_TYPES()["required"], **Qwen21LoraLoader.INPUT_TYPES()["optional"]}
    assert all(options.get("tooltip") for _type, options in specs.values())
    (with_lora,) = Qwen21LoraLoader().load(base, TINY_LORA, 0.8)
    assert with_lora is not base and with_lora.pipe is base.pipe
    assert base.loras == () and [(lora.path.name, s) for lora, s in with_lora.loras] == [(TINY_LORA, 0.8)]
    (stacked,) = Qwen21LoraLoader().load(with_lora, TINY_LORA, -0.3)
    assert [s for _, s in stacked.loras] == [0.8, -0.3] and len(with_lora.loras) == 1
    assert TINY_LORA in repr(stacked)


def test_a_strength_change_reuses_the_file_as_read_and_an_edited_file_is_read_again(base, monkeypatch, tmp_path):
    """As ComfyUI's LoraLoader keeps its last file: the 335.6 MB rank-64 file is not read again for a new strength;
    a file that changed on disk is."""
    import os
    import shutil

    from qwen21_nodes.qwen21_core.lora import files

    reads = []
    real = files.read_lora
    monkeypatch.setattr(files, "read_lora", lambda path, shapes: reads.append(path) or real(path, shapes))
    path = tmp_path / "copy.safetensors"
    shutil.copy(host.weight_file_path("loras", TINY_LORA), path)
    first = base.pipe.load_lora(path)
    again = base.pipe.load_lora(path, side_path=True)
    assert len(reads) == 1 and again.side_path and not first.side_path
    assert first.layers is again.layers  # the same tensors, not a second read
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    base.pipe.load_lora(path)
    assert len(reads) == 2
    for index in range(files.READ_LORAS_KEPT + 1):  # only the latest few are kept
        other = tmp_path / f"other_{index}.safetensors"
        shutil.copy(path, other)
        base.pipe.load_lora(other)
    assert len(base.pipe.read_loras.entries) == files.READ_LORAS_KEPT


def test_branches_with_different_loras_are_each_right_in_any_order(base, models_dir):
    cond = base.encode(prompt="a red apple", output_resolution=64)
    (full,) = Qwen21LoraLoader().load(base, TINY_LORA, 1.0)
    (half,) = Qwen21LoraLoader().load(base, TINY_LORA, 0.5)
    (halves,) = Qwen21LoraLoader().load(half, TINY_LORA, 0.5)
    (off,) = Qwen21LoraLoader().load(base, TINY_LORA, 0.0)
    plain = sample(base, cond)
    with_full = sample(full, cond)
    with_half = sample(half, cond)
    assert not torch.allclose(plain, with_full, atol=1e-3) and not torch.allclose(with_half, with_full, atol=1e-3)
    assert torch.equal(sample(full, cond), with_full)  # again, after another LoRA set
    torch.testing.assert_close(sample(halves, cond), with_full, rtol=1e-4, atol=1e-5)  # 0.5 + 0.5 = 1
    assert torch.equal(sample(off, cond), plain)  # strength 0 is the base model exactly
    assert torch.equal(sample(base, cond), plain)
    stored = checkpoint_weights(models_dir)  # the base handle left the weights as loaded, bit for bit
    assert all(torch.equal(t, stored[k]) for k, t in base.pipe.transformer.checkpoint_slots().items())
    assert base.pipe.loras.originals.nbytes == 0  # re-read from the file: no copies held


def test_the_nodes_strength_scales_the_loras_change_to_the_weights(base, models_dir):
    """What the DiT samples with after the node at strength s: the stored weights plus s times the LoRA's change, so
    0.5 is half of 1.0's change and -1 its opposite, to fp32 rounding of the once-rounded merge."""
    cond = base.encode(prompt="a red apple", output_resolution=64)
    stored = checkpoint_weights(models_dir)

    def change(strength):
        (handle,) = Qwen21LoraLoader().load(base, TINY_LORA, strength)
        sample(handle, cond)  # the strength is merged where the DiT runs, before its steps
        return {k: t.double() - stored[k].double() for k, t in base.pipe.transformer.checkpoint_slots().items()}

    full, half, minus = change(1.0), change(0.5), change(-1.0)
    sample(base, cond)  # the base handle takes the LoRA off again
    changed = [k for k, delta in full.items() if delta.abs().max() > 0]
    assert changed and len(changed) < len(full)  # the LoRA's layers, not every weight
    for k in full:
        # fp32 rounding of the delta and of w + delta, for both strengths compared: within 2 ulp of the largest
        rounding = 2.0**-22 * (stored[k].double().abs() + full[k].abs())
        assert ((half[k] - 0.5 * full[k]).abs() <= rounding).all(), f"{k}: strength 0.5 is not half of 1.0"
        assert ((minus[k] + full[k]).abs() <= rounding).all(), f"{k}: strength -1 is not the opposite of 1.0"


def test_mode_is_optional_so_workflows_saved_without_it_still_load(base, models_dir):
    modes, options = Qwen21LoraLoader.INPUT_TYPES()["optional"]["mode"]
    assert modes == ["merge", "side_path"] and options["default"] == "merge"
    assert "mode" not in Qwen21LoraLoader.INPUT_TYPES()["required"]
    (merged,) = Qwen21LoraLoader().load(base, TINY_LORA, 1.0)  # as a workflow without the input calls it
    (beside,) = Qwen21LoraLoader().load(base, TINY_LORA, 1.0, mode="side_path")
    assert not merged.loras[0][0].side_path and beside.loras[0][0].side_path
    with pytest.raises(ValueError, match="mode must be one of"):
        Qwen21LoraLoader().load(base, TINY_LORA, 1.0, mode="fuse")

    from qwen21_nodes.runner.cli import WORKFLOWS_DIR, tiny_overrides
    from qwen21_nodes.runner.graph import apply_overrides, validate
    from test_workflows import node_classes

    # the UI file as saved before the input existed: one widget value fewer; the API file without the input
    ui = json.loads((WORKFLOWS_DIR / "turbo_lora.json").read_text())
    node = next(n for n in ui["nodes"] if n["type"] == "Qwen21LoraLoader")
    assert node["widgets_values"][-1] == "merge"
    node["widgets_values"] = node["widgets_values"][:-1]
    assert check_ui_workflow(ui, node_classes()) == []
    prompt = ui_to_api(ui, node_classes())
    assert "mode" not in prompt[str(node["id"])]["inputs"]
    validate(apply_overrides(prompt, tiny_overrides(prompt, models_dir), node_classes()), node_classes())  # or raises
    node["widgets_values"] = node["widgets_values"][:-1]  # a required value missing is still an error
    assert "1 widgets_values, expected 2 to 3" in " ".join(check_ui_workflow(ui, node_classes()))


@pytest.mark.parametrize("weight_dtype,mode", [("fp8", "side_path"), ("fp8", "merge"), ("int8", "side_path"),
                                               ("int8_convrot", "merge")])  # fmt: skip
def test_lora_workflow_on_quantised_weights_through_the_runner(models_dir, tmp_path, weight_dtype, mode):
    """The turbo_lora workflow as a user runs it on CPU with a quantised DiT (fp8 with the side path crashed in the
    sampler with 'expected m1 and m2 to have the same dtype' before issue 23)."""
    from qwen21_nodes.runner.cli import WORKFLOWS_DIR, run_workflow, tiny_overrides
    from qwen21_nodes.runner.graph import find_node, load_prompt

    path = WORKFLOWS_DIR / "api" / "turbo_lora.json"
    prompt = load_prompt(path.read_text())
    settings = [*tiny_overrides(prompt, models_dir), f"1.weight_dtype={weight_dtype}", "1.device=cpu",
                f"6.mode={mode}"]  # fmt: skip
    sampler = find_node(prompt, "Qwen21Sampler")

    def latents(strength):
        result = run_workflow(path, models_dir=models_dir, output_dir=tmp_path,
                              overrides=[*settings, f"6.strength={strength}"])  # fmt: skip
        return result.outputs[sampler][0]["samples"]

    with_lora = latents(1.0)
    assert torch.isfinite(with_lora).all()
    assert not torch.allclose(with_lora, latents(0.0), atol=1e-3)


def test_node_errors_name_the_file_and_the_problem(base, models_dir, tmp_path):
    (tmp_path / "loras").mkdir()
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(8, 4)},
              tmp_path / "loras" / "flux.safetensors")  # fmt: skip
    host.set_models_dir(tmp_path)
    try:
        with pytest.raises(LoraError, match=r"LoRA flux.safetensors: 1 layers that match nothing .*Flux"):
            Qwen21LoraLoader().load(base, "flux.safetensors", 1.0)
        with pytest.raises(FileNotFoundError, match="'missing.safetensors' not found in the loras folder"):
            Qwen21LoraLoader().load(base, "missing.safetensors", 1.0)
    finally:
        host.set_models_dir(models_dir)


# ---- prefix cache and decode graphs ----------------------------------------------------------------------


@pytest.fixture()
def dit_and_lora(tmp_path):
    model = our_dit(reference_dit())
    path = write(tmp_path / "a.safetensors", *lora_state_dict(random_factors(model), "comfyui"))
    return model, read_lora(path, layer_shapes(model))


def _cond():
    g = torch.Generator().manual_seed(4)
    prompt = PromptEmbedding(torch.randn(9, 48, generator=g), torch.zeros(9, dtype=torch.bool))
    return Conditioning(prompt, content_hash="abc")


def test_a_kept_prefix_is_not_reused_across_lora_sets_and_graphs_stay(dit_and_lora):
    model, lora = dit_and_lora
    mean, std = torch.zeros(16), torch.ones(16)
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    merger = LoraMerger(model, MemoryOriginals())
    cond, kw = _cond(), dict(height=64, width=64, steps=3, seed=2)

    def run():
        sampler = Sampler(model, QWEN21_SCHEDULER, mean, std, decode_runner=graphs)
        out = sampler.sample([cond], **kw)
        graphs.end_generation()
        return out, sampler.stats.prefills

    plain, prefills = run()
    assert prefills == 1
    (entry,) = graphs.entries.values()
    ptrs = [p.data_ptr() for p in model.parameters()]
    merger.apply([(lora, 1.0)])
    with_lora, prefills = run()
    assert prefills == 1, "the prefix kept from the run without the LoRA was reused"
    assert torch.equal(with_lora, Sampler(model, QWEN21_SCHEDULER, mean, std).sample([cond], **kw))
    assert not torch.allclose(with_lora, plain, atol=1e-3)
    out, prefills = run()
    assert prefills == 0 and torch.equal(out, with_lora)  # same LoRA set: the kept prefix is reused
    assert [p.data_ptr() for p in model.parameters()] == ptrs
    assert recorder.captures == 1 and list(graphs.entries.values()) == [entry]  # not recaptured
    merger.apply([])
    again, prefills = run()
    assert prefills == 1 and torch.equal(again, plain)
    assert recorder.captures == 1


def test_graph_manager_keeps_its_entries_when_a_lora_is_merged(dit_and_lora):
    model, lora = dit_and_lora
    recorder = Recorder()
    graphs = DecodeGraphs(model, launch_bound_share=0, capture=recorder)
    layout = _layout()
    branch = _prefilled(graphs, layout)
    x, t = torch.randn(1, 16, 16), torch.full((1,), 0.5)
    graphs(branch, x, t)
    graphs.release(branch)
    LoraMerger(model, MemoryOriginals()).apply([(lora, 1.0)])
    again = _prefilled(graphs, layout)
    assert again is branch and "weights moved" not in graphs.describe()
    assert torch.equal(graphs(again, x, t), model.decode(again, x, t))
    assert recorder.captures == 1


@pytest.mark.gpu
def test_cuda_graph_replays_the_merged_weights_without_recapture(dit_and_lora):
    model, lora = dit_and_lora
    model = model.to("cuda", torch.bfloat16)
    lora = read_lora(lora.path, layer_shapes(model))
    graphs = DecodeGraphs(model, launch_bound_share=0)
    layout = _layout()
    g = torch.Generator().manual_seed(0)
    embeds, tokens = torch.randn(layout.prefix_len - 12, 48, generator=g), torch.randn(16, 16, generator=g)
    branch = graphs.new_branch(layout, 1, "auto", "positive")
    x = torch.randn(1, 16, 16, generator=g).to("cuda", torch.bfloat16)
    t = torch.full((1,), 0.5, device="cuda", dtype=torch.bfloat16)
    model.prefill(branch, embeds.cuda(), tokens.cuda())
    before = graphs(branch, x, t)
    (entry,) = graphs.entries.values()
    graph = entry.graph
    LoraMerger(model, MemoryOriginals()).apply([(lora, 1.0)])
    model.prefill(branch, embeds.cuda(), tokens.cuda())  # the prefix depends on the weights (the sampler's job)
    replayed = graphs(branch, x, t)
    assert entry.graph is graph and entry.replays == 2  # the same graph, replayed
    assert torch.equal(replayed, model.decode(branch, x, t))
    assert not torch.equal(replayed, before)
