"""LoRA files and merging on the tiny DiT (CPU): every key format lands on the right rows of the right weight with
W + strength * alpha/rank * B @ A; merging is in place, rounds once, stacks, and comes off bit for bit (from CPU
copies or re-read from the checkpoint file); bad files get errors that say what is wrong."""

import json

import pytest
import torch
from dit_reference import TINY_DIT, reference_dit
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer
from qwen21_nodes.qwen21_core.lora.merge import (
    FileOriginals,
    LoraMerger,
    MemoryOriginals,
    layer_shapes,
    lora_layers,
    stack_identity,
)
from qwen21_nodes.qwen21_core.lora.reading import LoraError, read_lora
from safetensors.torch import save_file

RANK = 4
# Split, fused and non-block layers, so every kind of slot is exercised.
LAYERS = (
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.0.attn.to_v",
    "transformer_blocks.1.attn.to_qkv",
    "transformer_blocks.0.attn.to_out.0",
    "transformer_blocks.0.img_mlp.gate_layer",
    "transformer_blocks.0.img_mlp.proj",
    "transformer_blocks.1.img_mlp.gate_up",
    "transformer_blocks.1.img_mlp.out",
    "img_in",
    "txt_in.in_layer",
    "txt_in.out_layer",
    "modulation.1",
    "norm_out.linear",
    "proj_out",
    "time_text_embed.timestep_embedder.linear_1",
)
FORMATS = ("peft", "peft_bare", "peft_base_model", "peft_default", "peft_metadata", "kohya", "comfyui", "comfyui_diff")


def tiny_model(dtype=torch.float32) -> QwenImage21Transformer:
    """Our tiny DiT with the reference's random weights (non-trivial norms)."""
    model = QwenImage21Transformer(TransformerConfig(**TINY_DIT)).eval()
    model.load_diffusers_state_dict(reference_dit().state_dict())
    return model.to(dtype).requires_grad_(False)


def random_factors(model, layers=LAYERS, rank=RANK, seed=0, size=0.3):
    """layer -> (up [out, rank], down [rank, in]) of about `size` times the weights' scale."""
    g = torch.Generator().manual_seed(seed)
    shapes = layer_shapes(model)
    factors = {}
    for layer in layers:
        out, inp = shapes[layer]
        factors[layer] = (size * torch.randn(out, rank, generator=g), torch.randn(rank, inp, generator=g) / inp**0.5)
    return factors


def lora_state_dict(factors, fmt: str, alpha: float | None = 8.0):
    """The same LoRA in one of the key formats reading.py accepts: (tensors, safetensors metadata)."""
    tensors, metadata = {}, None
    for layer, (up, down) in factors.items():
        alpha_t = None if alpha is None else torch.tensor(alpha)
        if fmt == "peft":
            names = (f"transformer.{layer}.lora_B.weight", f"transformer.{layer}.lora_A.weight", None)
        elif fmt == "peft_bare":
            names = (f"{layer}.lora_B.weight", f"{layer}.lora_A.weight", f"{layer}.alpha")
        elif fmt == "peft_base_model":
            names = (f"base_model.model.{layer}.lora_B.weight", f"base_model.model.{layer}.lora_A.weight", None)
        elif fmt == "peft_default":
            names = (f"{layer}.lora_B.default.weight", f"{layer}.lora_A.default.weight", f"{layer}.alpha")
        elif fmt == "peft_metadata":
            names = (f"transformer.{layer}.lora_B.weight", f"transformer.{layer}.lora_A.weight", None)
        elif fmt == "kohya":
            flat = "lora_unet_" + layer.replace(".", "_")
            names = (f"{flat}.lora_up.weight", f"{flat}.lora_down.weight", f"{flat}.alpha")
        elif fmt == "comfyui":
            stem = f"diffusion_model.{layer}"
            names = (f"{stem}.lora_up.weight", f"{stem}.lora_down.weight", f"{stem}.alpha")
        elif fmt == "comfyui_diff":
            scale = 1.0 if alpha is None else alpha / up.shape[1]
            tensors[f"diffusion_model.{layer}.diff"] = (up @ down) * scale
            continue
        else:
            raise ValueError(fmt)
        tensors[names[0]], tensors[names[1]] = up, down
        if names[2] is not None and alpha_t is not None:
            tensors[names[2]] = alpha_t
    if fmt == "peft_metadata" and alpha is not None:
        config = {"transformer.r": RANK, "transformer.lora_alpha": alpha, "transformer.use_rslora": False}
        metadata = {"lora_adapter_metadata": json.dumps(config), "format": "pt"}
    return tensors, metadata


def write(path, tensors, metadata=None):
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    return path


def expected_weights(model, factors, strength, alpha):
    """Hand-computed merge: parameter -> W + strength * alpha/rank * B @ A on the layer's rows, rounded once."""
    slots = lora_layers(model)
    params = dict(model.named_parameters())
    merged = {}
    for layer, (up, down) in factors.items():
        slot = slots[layer]
        acc = merged.setdefault(slot.param, params[slot.param].float().clone())
        scale = 1.0 if alpha is None else alpha / up.shape[1]
        acc[slot.rows] += (up.float() @ down.float()) * (scale * strength)
    return {name: acc.to(params[name].dtype) for name, acc in merged.items()}


def snapshot(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def addresses(model):
    return [p.data_ptr() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_merges_onto_the_right_rows(fmt, tmp_path):
    model = tiny_model()
    factors = random_factors(model)
    alpha = None if fmt in ("peft", "peft_base_model") else 8.0  # plain PEFT files carry no alpha: scale 1
    path = write(tmp_path / f"{fmt}.safetensors", *lora_state_dict(factors, fmt, alpha))
    lora = read_lora(path, layer_shapes(model))
    assert sorted(layer.layer for layer in lora.layers) == sorted(LAYERS)
    before = snapshot(model)
    expected = expected_weights(model, factors, 0.7, alpha)
    LoraMerger(model, MemoryOriginals()).apply([(lora, 0.7)])
    for name, param in model.named_parameters():
        if name in expected:
            torch.testing.assert_close(param, expected[name], rtol=1e-6, atol=1e-6, msg=f"{fmt}: {name}")
            assert not torch.equal(param, before[name])
        else:
            assert torch.equal(param, before[name]), f"{fmt}: {name} changed but no LoRA layer targets it"


def test_layers_cover_every_linear_split_and_fused():
    model = tiny_model()
    layers = lora_layers(model)
    inner, hidden = model.config.inner_dim, model.config.mlp_dim
    assert layers["transformer_blocks.1.attn.to_k"].rows == slice(inner, 2 * inner)
    assert layers["transformer_blocks.1.attn.to_k"].param == "transformer_blocks.1.attn.to_qkv.weight"
    assert layers["transformer_blocks.1.img_mlp.proj"].rows == slice(hidden, 2 * hidden)
    assert layers["transformer_blocks.1.attn.to_qkv"].shape == (3 * inner, inner)
    # every linear (fused ones included) is addressable; checkpoints call our attn.to_out "attn.to_out.0"
    linears = {n.replace(".to_out", ".to_out.0") for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert len(linears) == 8 + 4 * model.config.num_layers and linears <= set(layers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("restore_from", ["memory", "file"])
def test_merge_then_remove_is_bit_identical_and_keeps_addresses(dtype, restore_from, tmp_path):
    model = tiny_model(dtype)
    before, ptrs = snapshot(model), addresses(model)
    if restore_from == "file":
        checkpoint = tmp_path / "dit.safetensors"
        save_file({k: v.contiguous() for k, v in model.checkpoint_slots().items()}, checkpoint)  # diffusers layout
        originals = FileOriginals(checkpoint)
    else:
        originals = MemoryOriginals()
    merger = LoraMerger(model, originals)
    path = write(tmp_path / "a.safetensors", *lora_state_dict(random_factors(model), "comfyui"))
    lora = read_lora(path, layer_shapes(model))
    merger.apply([(lora, 1.0)])
    assert addresses(model) == ptrs
    assert model.weights_id == stack_identity([(lora, 1.0)]) != ()
    merger.apply([(lora, -0.5)])  # a strength change recomputes from the originals
    merger.apply([])
    assert addresses(model) == ptrs and model.weights_id == ()
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert originals.nbytes == 0  # nothing kept once the weights are original again


@pytest.mark.gpu
def test_deltas_are_full_fp32_on_cuda_even_with_tf32_switched_on(tmp_path):
    cpu = tiny_model()
    lora = read_lora(write(tmp_path / "a.safetensors", *lora_state_dict(random_factors(cpu), "comfyui")),
                     layer_shapes(cpu))  # fmt: skip
    LoraMerger(cpu, MemoryOriginals()).apply([(lora, 1.0)])
    cuda = tiny_model().cuda()
    matmul = torch.backends.cuda.matmul
    saved, matmul.fp32_precision = matmul.fp32_precision, "tf32"  # as a host may set it
    try:
        LoraMerger(cuda, MemoryOriginals()).apply([(lora, 1.0)])
        assert matmul.fp32_precision == "tf32"  # the host's setting is left as it was
    finally:
        matmul.fp32_precision = saved
    for name, param in cuda.named_parameters():
        torch.testing.assert_close(param.cpu(), cpu.get_parameter(name), rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("restore_from", ["memory", "file"])
def test_merging_under_inference_mode_as_comfyui_runs_nodes(restore_from, tmp_path):
    model = tiny_model(torch.bfloat16)
    before = snapshot(model)
    checkpoint = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in model.checkpoint_slots().items()}, checkpoint)
    originals = FileOriginals(checkpoint) if restore_from == "file" else MemoryOriginals()
    path = write(tmp_path / "a.safetensors", *lora_state_dict(random_factors(model), "comfyui"))
    merger = LoraMerger(model, originals)
    with torch.inference_mode():
        lora = read_lora(path, layer_shapes(model))
        merger.apply([(lora, 1.0)])
        merger.apply([(lora, 0.3)])
    merger.apply([(lora, 1.0)])  # and later outside it, with what was made inside
    merger.apply([])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_file_originals_read_a_comfyui_checkpoint_with_fused_gate_up(tmp_path):
    from qwen21_nodes.qwen21_core.checkpoints.key_maps import dit_to_comfyui

    model = tiny_model(torch.bfloat16)
    checkpoint = tmp_path / "comfy.safetensors"
    state = {k: v.contiguous() for k, v in model.checkpoint_slots().items()}
    save_file({k: v.contiguous() for k, v in dit_to_comfyui(state).items()}, checkpoint)
    before = snapshot(model)
    merger = LoraMerger(model, FileOriginals(checkpoint))
    lora = read_lora(write(tmp_path / "a.safetensors", *lora_state_dict(random_factors(model), "kohya")),
                     layer_shapes(model))  # fmt: skip
    merger.apply([(lora, 1.0)])
    merger.apply([])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_stack_rounds_once_and_strength_changes_recompute_from_the_original(tmp_path):
    model = tiny_model(torch.bfloat16)
    original = snapshot(model)
    first, second = random_factors(model, seed=1), random_factors(model, seed=2)
    a = read_lora(write(tmp_path / "a.safetensors", *lora_state_dict(first, "comfyui")), layer_shapes(model))
    b = read_lora(write(tmp_path / "b.safetensors", *lora_state_dict(second, "peft_bare")), layer_shapes(model))
    slots = lora_layers(model)
    once, stepwise = {}, {}  # original + 0.8 A + 0.5 B in fp32 rounded once, and rounded after each LoRA
    for factors, strength in ((first, 0.8), (second, 0.5)):
        for layer, (up, down) in factors.items():
            slot, delta = slots[layer], (up @ down) * (8.0 / RANK * strength)
            once.setdefault(slot.param, original[slot.param].float())[slot.rows] += delta
            step = stepwise.setdefault(slot.param, original[slot.param].clone())
            step[slot.rows] = (step[slot.rows].float() + delta).to(torch.bfloat16)
    merger = LoraMerger(model, MemoryOriginals())
    merger.apply([(a, 0.8)])
    merger.apply([(a, 0.3), (b, 0.5)])
    merger.apply([(a, 0.8), (b, 0.5)])
    params = dict(model.named_parameters())
    for name, acc in once.items():
        assert torch.equal(params[name], acc.to(torch.bfloat16)), name
    assert any(not torch.equal(stepwise[n], params[n]) for n in stepwise)  # the test tells the two apart


def test_unchanged_weights_are_left_alone_when_a_second_lora_is_added(tmp_path):
    model = tiny_model()
    a = read_lora(write(tmp_path / "a.safetensors", *lora_state_dict(random_factors(model, LAYERS[:2]), "comfyui")),
                  layer_shapes(model))  # fmt: skip
    b = read_lora(write(tmp_path / "b.safetensors", *lora_state_dict(random_factors(model, ("img_in",)), "comfyui")),
                  layer_shapes(model))  # fmt: skip
    merger = LoraMerger(model, MemoryOriginals())
    merger.apply([(a, 1.0)])
    merger.apply([(a, 1.0), (b, 1.0)])
    assert merger.last_stats["weights_merged"] == 1 and merger.last_stats["weights_restored"] == 0
    merger.apply([(b, 1.0)])
    assert merger.last_stats["weights_merged"] == 0 and merger.last_stats["weights_restored"] == 1


def test_a_failed_merge_leaves_the_original_weights(tmp_path):
    model = tiny_model(torch.float16)
    before = snapshot(model)
    factors = random_factors(model)
    factors["proj_out"] = (factors["proj_out"][0] * 1e6, factors["proj_out"][1])  # overflows fp16
    lora = read_lora(write(tmp_path / "big.safetensors", *lora_state_dict(factors, "comfyui")), layer_shapes(model))
    merger = LoraMerger(model, MemoryOriginals())
    with pytest.raises(LoraError, match=r"proj_out gives .* beyond torch.float16"):
        merger.apply([(lora, 1.0)])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert model.weights_id == () and merger.merged == {}


def test_a_failed_restore_never_leaves_the_old_stack_named_over_changed_weights(tmp_path, monkeypatch):
    """A change to stack B fails half way and so does the restore after it: the weights are then neither the
    originals nor stack A. Nothing may still name stack A (the next apply of A would be skipped, and kept prefix
    caches keyed on it reused); the next apply starts from the originals and gives exactly A, then nothing."""
    from qwen21_nodes.qwen21_core.lora import merge

    model = tiny_model()
    before = snapshot(model)
    a_factors, b_factors = random_factors(model, seed=1), random_factors(model, seed=2)
    lora_a = read_lora(write(tmp_path / "a.safetensors", *lora_state_dict(a_factors, "comfyui")), layer_shapes(model))
    lora_b = read_lora(write(tmp_path / "b.safetensors", *lora_state_dict(b_factors, "comfyui")), layer_shapes(model))
    merger = LoraMerger(model, MemoryOriginals())
    merger.apply([(lora_a, 1.0)])
    with_a = snapshot(model)
    a_id = stack_identity([(lora_a, 1.0)])
    assert model.weights_id == a_id

    real_merge, merges = merge.merge_into_weight, []

    def merge_then_fail(*args):
        merges.append(args)
        if len(merges) == 3:
            raise RuntimeError("injected: merge failed")
        return real_merge(*args)

    real_restore = merger.originals.restore

    def restore_fails(*args):  # after the failed merge: the restore that should undo it fails too
        if len(merges) >= 3:
            raise RuntimeError("injected: restore failed")
        return real_restore(*args)

    monkeypatch.setattr(merge, "merge_into_weight", merge_then_fail)
    monkeypatch.setattr(merger.originals, "restore", restore_fails)
    with pytest.raises(RuntimeError, match="injected: restore failed"):
        merger.apply([(lora_b, 1.0)])
    assert any(not torch.equal(p, with_a[n]) for n, p in model.named_parameters())  # half merged
    assert merger.stack_id != a_id and model.weights_id != a_id
    monkeypatch.undo()
    merger.apply([(lora_a, 1.0)])
    assert all(torch.equal(p, with_a[n]) for n, p in model.named_parameters()) and model.weights_id == a_id
    merger.apply([])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()) and model.weights_id == ()


def test_file_originals_refuse_a_checkpoint_that_changed(tmp_path):
    model = tiny_model()
    checkpoint = tmp_path / "dit.safetensors"
    save_file({k: v.contiguous() for k, v in model.checkpoint_slots().items()}, checkpoint)
    merger = LoraMerger(model, FileOriginals(checkpoint))
    lora = read_lora(write(tmp_path / "a.safetensors", *lora_state_dict(random_factors(model), "comfyui")),
                     layer_shapes(model))  # fmt: skip
    merger.apply([(lora, 1.0)])
    save_file({k: v.contiguous() + 1 for k, v in model.checkpoint_slots().items()}, checkpoint)
    with pytest.raises(LoraError, match="changed on disk since the model was loaded"):
        merger.apply([])


# ---- errors --------------------------------------------------------------------------------------------


def _read(tmp_path, tensors, model=None, metadata=None):
    model = model or tiny_model()
    return read_lora(write(tmp_path / "x.safetensors", tensors, metadata), layer_shapes(model))


def test_lora_for_another_model_is_refused_naming_the_layers(tmp_path):
    # Qwen-Image 1.x: double-stream blocks, 3072 wide
    qwen1 = {
        "transformer.transformer_blocks.0.attn.add_q_proj.lora_A.weight": torch.zeros(4, 3072),
        "transformer.transformer_blocks.0.attn.add_q_proj.lora_B.weight": torch.zeros(3072, 4),
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 3072),
        "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(3072, 4),
    }
    with pytest.raises(LoraError, match=r"1 layers that match nothing .*add_q_proj.*Qwen-Image 1.x"):
        _read(tmp_path, qwen1)
    flux = {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, 64),
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(192, 4),
    }
    with pytest.raises(LoraError, match=r"match nothing .*\(0 of 1 matched\). .*Flux"):
        _read(tmp_path, flux)


def test_same_names_with_other_shapes_are_refused(tmp_path):
    wide = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(4, 3072),
            "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.zeros(3072, 4)}  # fmt: skip
    with pytest.raises(
        LoraError, match=r"does not fit .*to_q: up \[3072, 4\] @ down \[4, 3072\] .* weight is \[64, 64\]"
    ):
        _read(tmp_path, wide)


def test_unknown_keys_are_listed(tmp_path):
    model = tiny_model()
    tensors, _ = lora_state_dict(random_factors(model, ("img_in",)), "comfyui")
    tensors["diffusion_model.img_in.lora_up.weight_ema"] = torch.zeros(1)
    tensors["some_counter"] = torch.zeros(1)
    with pytest.raises(LoraError, match=r"2 keys of no known LoRA format: diffusion_model.img_in.lora_up.weight_ema"):
        _read(tmp_path, tensors, model)


def test_wrong_rank_shapes_name_the_layer(tmp_path):
    tensors = {"diffusion_model.img_in.lora_down.weight": torch.zeros(3, 16),
               "diffusion_model.img_in.lora_up.weight": torch.zeros(64, 4)}  # fmt: skip
    with pytest.raises(
        LoraError, match=r"img_in: up \[64, 4\] and down \[3, 16\] are not \[out, rank\] and \[rank, in\]"
    ):
        _read(tmp_path, tensors)
    with pytest.raises(LoraError, match=r"needs both up and down"):
        _read(tmp_path, {"diffusion_model.img_in.lora_up.weight": torch.zeros(64, 4)})
    with pytest.raises(LoraError, match=r"alpha has shape \[2\]"):
        _read(tmp_path, {"img_in.lora_A.weight": torch.zeros(4, 16), "img_in.lora_B.weight": torch.zeros(64, 4),
                         "img_in.alpha": torch.zeros(2)})  # fmt: skip
    with pytest.raises(LoraError, match=r"difference \[2, 2\] vs weight \[64, 16\]"):
        _read(tmp_path, {"diffusion_model.img_in.diff": torch.zeros(2, 2)})


@pytest.mark.parametrize(
    "key, kind",
    [
        ("lora_unet_img_in.hada_w1_a", "LoHa"),
        ("lora_unet_img_in.lokr_w1", "LoKr"),
        ("diffusion_model.img_in.dora_scale", "DoRA"),
        ("transformer.img_in.lora_magnitude_vector", "DoRA"),
        ("lora_unet_img_in.oft_blocks", "OFT"),
        ("diffusion_model.img_in.diff_b", "bias"),
    ],
)
def test_unsupported_adapter_kinds_are_named(tmp_path, key, kind):
    tensors = {key: torch.zeros(4, 4), "lora_unet_img_in.lora_down.weight": torch.zeros(4, 16),
               "lora_unet_img_in.lora_up.weight": torch.zeros(64, 4)}  # fmt: skip
    with pytest.raises(LoraError, match=rf"uses {kind}.*\(e.g. {key}\), which qwen21-nodes cannot apply"):
        _read(tmp_path, tensors)


def test_dora_in_peft_metadata_is_refused(tmp_path):
    tensors = {"img_in.lora_A.weight": torch.zeros(4, 16), "img_in.lora_B.weight": torch.zeros(64, 4)}
    with pytest.raises(LoraError, match="use_dora"):
        _read(tmp_path, tensors, metadata={"lora_adapter_metadata": json.dumps({"transformer.use_dora": True})})


def test_text_encoder_parts_are_refused(tmp_path):
    tensors = {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 8),
               "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, 4),
               "lora_unet_img_in.lora_down.weight": torch.zeros(4, 16),
               "lora_unet_img_in.lora_up.weight": torch.zeros(64, 4)}  # fmt: skip
    with pytest.raises(LoraError, match="1 text-encoder layers: lora_te_text_model.*diffusion model only"):
        _read(tmp_path, tensors)


def test_not_a_lora_file(tmp_path):
    model = tiny_model()
    full = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.checkpoint_slots().items()}, full)
    with pytest.raises(LoraError, match=r"model.safetensors: not a LoRA file: it is the Qwen-Image-2.1 transformer"):
        read_lora(full, layer_shapes(model))
    pickle = tmp_path / "lora.pt"
    torch.save({"img_in.lora_A.weight": torch.zeros(4, 16)}, pickle)
    with pytest.raises(LoraError, match=r"lora.pt: .*pickle.*never opened"):
        read_lora(pickle, layer_shapes(model))
    garbage = tmp_path / "lora.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    with pytest.raises(LoraError, match="not a safetensors file"):
        read_lora(garbage, layer_shapes(model))
    with pytest.raises(FileNotFoundError):
        read_lora(tmp_path / "missing.safetensors", layer_shapes(model))


def test_a_layer_named_twice_is_refused(tmp_path):
    tensors = {"transformer.img_in.lora_A.weight": torch.zeros(4, 16),
               "transformer.img_in.lora_B.weight": torch.zeros(64, 4),
               "diffusion_model.img_in.lora_down.weight": torch.zeros(4, 16),
               "diffusion_model.img_in.lora_up.weight": torch.zeros(64, 4)}  # fmt: skip
    with pytest.raises(LoraError, match="layers named twice: img_in"):
        _read(tmp_path, tensors)


def test_peft_alpha_pattern_and_rslora(tmp_path):
    model = tiny_model()
    tensors, _ = lora_state_dict(random_factors(model, ("img_in", "proj_out")), "peft")
    config = {"transformer.r": RANK, "transformer.lora_alpha": 2, "transformer.alpha_pattern": {"proj_out": 16}}
    lora = _read(tmp_path, tensors, model, {"lora_adapter_metadata": json.dumps(config)})
    assert {layer.layer: layer.scale for layer in lora.layers} == {"img_in": 0.5, "proj_out": 4.0}
    config = {"transformer.lora_alpha": 8, "transformer.use_rslora": True}
    lora = _read(tmp_path, tensors, model, {"lora_adapter_metadata": json.dumps(config)})
    assert {layer.scale for layer in lora.layers} == {8 / RANK**0.5}


_CHILD_READ = """
import json, sys
from qwen21_nodes.qwen21_core.lora.reading import read_lora
lora = read_lora(sys.argv[1], {k: tuple(v) for k, v in json.loads(sys.argv[2]).items()})
print(json.dumps({layer.layer: layer.scale for layer in lora.layers}))
"""


def test_a_regex_bomb_in_alpha_pattern_is_matched_quickly(tmp_path):
    """alpha_pattern keys are PEFT's regular expressions; a key that makes a backtracking engine run for ever on a
    30-character layer name is matched by a linear-time automaton instead (in a child process, so that a regression
    cannot freeze the test run: Python's re holds the interpreter lock while it backtracks)."""
    import subprocess
    import sys
    import time

    shapes = {"transformer_blocks.0.attn.to_q": (32, 32), "transformer_blocks.0.attn.to_k": (32, 32),
              "proj_out": (16, 32)}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer, (out, inp) in shapes.items():
        tensors[f"transformer.{layer}.lora_B.weight"] = torch.randn(out, RANK, generator=g)
        tensors[f"transformer.{layer}.lora_A.weight"] = torch.randn(RANK, inp, generator=g)
    # the bomb comes first: it must be tried (and not match: no layer ends in an upper-case Q) before the next keys
    patterns = {"(.|.)*Q": 99, "attn\\.to_[k]": 12, "proj_out": 16}
    config = {"transformer.r": RANK, "transformer.lora_alpha": 2, "transformer.alpha_pattern": patterns}
    path = write(tmp_path / "bomb.safetensors", tensors, {"lora_adapter_metadata": json.dumps(config)})
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-P", "-c", _CHILD_READ, str(path), json.dumps(shapes)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    scales = json.loads(child.stdout.strip().splitlines()[-1])
    assert scales == {"transformer_blocks.0.attn.to_q": 2 / RANK, "transformer_blocks.0.attn.to_k": 12 / RANK,
                      "proj_out": 16 / RANK}  # fmt: skip
    assert time.perf_counter() - started < 60  # a child's start and torch import included; the match is microseconds


def test_alpha_patterns_match_like_peft(tmp_path):
    """PEFT's rule (a key matches a whole layer name or its end after a dot, the first key wins) on module names,
    on regular expressions, and on keys no safe matcher takes (refused naming the file and the key)."""
    from qwen21_nodes.qwen21_core.lora.patterns import LayerPatterns

    patterns = LayerPatterns(["0.attn.to_q", "transformer_blocks\\.1\\d*\\.attn\\.to_(q|k)$", "to_q", "img_in"])
    assert patterns.find("transformer_blocks.0.attn.to_q") == "0.attn.to_q"
    assert patterns.find("transformer_blocks.10.attn.to_q") == "transformer_blocks\\.1\\d*\\.attn\\.to_(q|k)$"
    assert patterns.find("transformer_blocks.2.attn.to_q") == "to_q"
    assert patterns.find("transformer_blocks.2.attn.to_qkv") is None  # the end of the name, not a prefix of it
    assert patterns.find("ximg_in") is None and patterns.find("a.img_in") == "img_in"  # after a dot only
    model = tiny_model()
    tensors, _ = lora_state_dict(random_factors(model, ("img_in",)), "peft")
    for key, what in (("(?=x)img_in", "lookaround"), ("(a)\\1", "escape"), ("(" + "a?" * 40 + "){1,99}", "states")):
        config = {"transformer.lora_alpha": 2, "transformer.alpha_pattern": {key: 4}}
        with pytest.raises(LoraError, match=rf"LoRA x.safetensors: .*alpha_pattern.*{what}"):
            _read(tmp_path, tensors, model, {"lora_adapter_metadata": json.dumps(config)})


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"lora_alpha": float("nan")}, "lora_alpha"),
        ({"lora_alpha": float("inf")}, "lora_alpha"),
        ({"lora_alpha": -8}, "lora_alpha"),
        ({"lora_alpha": "8"}, "lora_alpha"),
        ({"lora_alpha": True}, "lora_alpha"),
        ({"lora_alpha": 10**400}, "lora_alpha"),
        ({"alpha_pattern": {"img_in": float("nan")}}, "alpha_pattern\\['img_in'\\]"),
        ({"alpha_pattern": {"img_in": [1]}}, "alpha_pattern\\['img_in'\\]"),
        ({"alpha_pattern": ["img_in"]}, "alpha_pattern"),
        ({"r": 0}, "'r'"),
        ({"rank_pattern": {"img_in": 0}}, "rank_pattern\\['img_in'\\]"),
        ({"rank_pattern": {"img_in": 2.5}}, "rank_pattern\\['img_in'\\]"),
    ],
)
def test_bad_alpha_or_rank_in_metadata_is_a_lora_error(tmp_path, config, named):
    model = tiny_model()
    tensors, _ = lora_state_dict(random_factors(model, ("img_in",)), "peft")
    metadata = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})}
    with pytest.raises(LoraError, match=rf"LoRA x.safetensors: .*{named}"):
        _read(tmp_path, tensors, model, metadata)


def test_rank_zero_and_bad_alpha_tensors_are_lora_errors(tmp_path):
    model = tiny_model()
    zero_rank = {"img_in.lora_A.weight": torch.zeros(0, 16), "img_in.lora_B.weight": torch.zeros(64, 0)}
    with pytest.raises(LoraError, match=r"LoRA x.safetensors .*img_in: rank 0"):
        _read(tmp_path, zero_rank, model)
    for alpha in (float("nan"), float("inf"), -4.0):
        tensors, _ = lora_state_dict(random_factors(model, ("img_in",)), "kohya", alpha=alpha)
        with pytest.raises(LoraError, match=r"LoRA x.safetensors: lora_unet_img_in.alpha is .*, expected a finite"):
            _read(tmp_path, tensors, model)
    for metadata in ('["not", "a", "dict"]', "{not json", "[" * 100_000 + "]" * 100_000,
                     '{"transformer.lora_alpha": ' + "9" * 5000 + "}"):  # deep nesting, a 5,000-digit number
        with pytest.raises(LoraError, match="LoRA x.safetensors: .*lora_adapter_metadata"):
            _read(tmp_path, lora_state_dict(random_factors(model, ("img_in",)), "peft")[0], model,
                  {"lora_adapter_metadata": metadata})  # fmt: skip


def test_a_full_difference_on_a_norm_weight_merges_and_comes_off(tmp_path):
    model = tiny_model(torch.bfloat16)
    before = snapshot(model)
    name = "transformer_blocks.1.attn.norm_q"
    param = lora_layers(model)[name].param  # our attn.norm_q_weight
    diff = torch.linspace(-0.5, 0.5, model.get_parameter(param).shape[0])
    lora = read_lora(write(tmp_path / "norm.safetensors", {f"diffusion_model.{name}.diff": diff}), layer_shapes(model))
    merger = LoraMerger(model, MemoryOriginals())
    merger.apply([(lora, 0.5)])
    assert torch.equal(model.get_parameter(param), (before[param].float() + 0.5 * diff).to(torch.bfloat16))
    merger.apply([])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
