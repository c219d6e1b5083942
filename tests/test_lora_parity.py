"""LoRA parity with diffusers 0.42.1 (fp32, CPU, tiny DiT): the same file through diffusers' `load_lora_weights` +
`fuse_lora` on its QwenImage21 transformer gives the weights (and velocities) we get by merging.

What diffusers cannot load directly is compared as follows, and the test names say so:
- no `transformer.` prefix / PEFT's `base_model.model.` (diffusers finds no keys, loads nothing and only warns):
  the same tensors under diffusers' own names through `transformer.load_lora_adapter(prefix=None)`;
- kohya names: diffusers' converter mangles `img_mlp_gate_layer`, `modulation_1` and `txt_in_*_layer`, so those
  layers are checked against the hand-computed W + s * alpha/rank * B @ A (test_lora.py) and the rest here;
- the fused `to_qkv` / `gate_up` layouts (diffusers has only the split layers): diffusers on the equivalent split
  LoRA (up rows split, down shared), which is the same delta;
- ComfyUI `.diff` full differences: not a diffusers format; hand-computed in test_lora.py.
"""

import pytest
import torch
from dit_reference import CHANNELS, CONTEXT, our_dit, prompt_mask, reference_dit, reference_pipeline, reference_velocity
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.lora.merge import LoraMerger, MemoryOriginals, layer_shapes
from qwen21_nodes.qwen21_core.lora.reading import read_lora
from test_lora import LAYERS, RANK, lora_state_dict, random_factors, write

pytest.importorskip("diffusers")
pytest.importorskip("peft", reason="diffusers' LoRA loading needs peft (pip install peft)")

STRENGTH = 0.7
SPLIT_LAYERS = tuple(name for name in LAYERS if not name.endswith((".to_qkv", ".gate_up")))
# kohya names diffusers 0.42.1's Qwen converter turns back into the right module names
KOHYA_BY_DIFFUSERS = tuple(
    name for name in SPLIT_LAYERS if not name.endswith(("gate_layer", "modulation.1", "in_layer", "out_layer"))
)


def _vae():
    from dit_reference import tiny_reference_vae

    return tiny_reference_vae()


def diffusers_fused(path=None, state_dict=None, strength=STRENGTH):
    """A fresh reference DiT with the LoRA loaded and fused by diffusers; its state dict."""
    ref = reference_dit()
    pipe = reference_pipeline(ref, _vae())
    if path is not None:
        pipe.load_lora_weights(str(path))
    else:
        ref.load_lora_adapter(state_dict, prefix=None)
    loaded = [n for n, _ in ref.named_modules() if n.endswith(".lora_A")]
    pipe.fuse_lora(lora_scale=strength)
    pipe.unload_lora_weights()
    return ref, loaded


def ours_merged(path, strength=STRENGTH):
    model = our_dit(reference_dit())
    LoraMerger(model, MemoryOriginals()).apply([(read_lora(path, layer_shapes(model)), strength)])
    return model


def assert_same_weights(model, ref, layers):
    theirs = ref.state_dict()
    original = reference_dit().state_dict()
    for key, ours in model.checkpoint_slots().items():
        torch.testing.assert_close(ours, theirs[key], rtol=1e-5, atol=1e-6, msg=key)
        touched = key.removesuffix(".weight") in layers
        assert touched != torch.equal(theirs[key], original[key]), f"{key}: touched by the LoRA is {touched}"


@pytest.mark.parametrize("fmt", ["peft", "peft_default", "peft_bare", "comfyui"])
def test_diffusers_loads_the_same_file(fmt, tmp_path):
    factors = random_factors(our_dit(reference_dit()), SPLIT_LAYERS)
    alpha = None if fmt == "peft" else 8.0
    path = write(tmp_path / f"{fmt}.safetensors", *lora_state_dict(factors, fmt, alpha))
    ref, loaded = diffusers_fused(path)
    assert len(loaded) == len(SPLIT_LAYERS), f"diffusers loaded {len(loaded)} layers"
    assert_same_weights(ours_merged(path), ref, SPLIT_LAYERS)


def test_diffusers_own_saved_file_with_alpha_in_its_metadata(tmp_path):
    from diffusers import QwenImage21Pipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    trained = reference_dit()
    config = LoraConfig(r=RANK, lora_alpha=3 * RANK, target_modules=list(SPLIT_LAYERS), init_lora_weights=False)
    trained.add_adapter(config)
    QwenImage21Pipeline.save_lora_weights(
        tmp_path, transformer_lora_layers=get_peft_model_state_dict(trained),
        transformer_lora_adapter_metadata=config.to_dict(), weight_name="saved.safetensors",
    )  # fmt: skip
    path = tmp_path / "saved.safetensors"
    lora = read_lora(path, layer_shapes(our_dit(reference_dit())))
    assert {layer.scale for layer in lora.layers} == {3.0}  # lora_alpha / r from the metadata
    ref, loaded = diffusers_fused(path)
    assert len(loaded) == len(SPLIT_LAYERS)
    assert_same_weights(ours_merged(path), ref, SPLIT_LAYERS)


@pytest.mark.parametrize("fmt", ["peft_bare", "peft_base_model"])
def test_unprefixed_names_against_diffusers_own_names(fmt, tmp_path):
    factors = random_factors(our_dit(reference_dit()), SPLIT_LAYERS)
    tensors, _ = lora_state_dict(factors, fmt, alpha=None)
    path = write(tmp_path / f"{fmt}.safetensors", tensors)
    as_diffusers = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    ref, loaded = diffusers_fused(state_dict=as_diffusers)
    assert len(loaded) == len(SPLIT_LAYERS)
    assert_same_weights(ours_merged(path), ref, SPLIT_LAYERS)


def test_kohya_names_diffusers_converts(tmp_path):
    factors = random_factors(our_dit(reference_dit()), KOHYA_BY_DIFFUSERS)
    path = write(tmp_path / "kohya.safetensors", *lora_state_dict(factors, "kohya", alpha=2.0))
    ref, loaded = diffusers_fused(path)
    assert len(loaded) == len(KOHYA_BY_DIFFUSERS)
    assert_same_weights(ours_merged(path), ref, KOHYA_BY_DIFFUSERS)


def test_fused_layouts_against_diffusers_on_the_split_equivalent(tmp_path):
    model = our_dit(reference_dit())
    inner, hidden = model.config.inner_dim, model.config.mlp_dim
    fused = random_factors(model, ("transformer_blocks.0.attn.to_qkv", "transformer_blocks.1.img_mlp.gate_up"))
    path = write(tmp_path / "fused.safetensors", *lora_state_dict(fused, "comfyui", alpha=2.0))
    split = {}
    (qkv_up, qkv_down), (gu_up, gu_down) = fused.values()
    for i, name in enumerate(("to_q", "to_k", "to_v")):
        split[f"transformer_blocks.0.attn.{name}"] = (qkv_up[i * inner : (i + 1) * inner], qkv_down)
    split["transformer_blocks.1.img_mlp.gate_layer"] = (gu_up[:hidden], gu_down)
    split["transformer_blocks.1.img_mlp.proj"] = (gu_up[hidden:], gu_down)
    split_path = write(tmp_path / "split.safetensors", *lora_state_dict(split, "comfyui", alpha=2.0))
    ref, loaded = diffusers_fused(split_path)
    assert len(loaded) == 5
    assert_same_weights(ours_merged(path), ref, set(split))


def test_velocity_with_the_lora_matches_diffusers(tmp_path):
    factors = random_factors(our_dit(reference_dit()), SPLIT_LAYERS)
    path = write(tmp_path / "comfyui.safetensors", *lora_state_dict(factors, "comfyui", alpha=8.0))
    ref, _ = diffusers_fused(path)
    ours = ours_merged(path)
    g = torch.Generator().manual_seed(3)
    shapes, target = [(4, 4)], (4, 6)
    mask = prompt_mask(5, shapes)
    embeds, cond = torch.randn(mask.shape[0], CONTEXT, generator=g), torch.randn(16, CHANNELS, generator=g)
    x, t = torch.randn(1, 24, CHANNELS, generator=g), torch.full((1,), 0.6)
    expected = reference_velocity(ref, embeds, mask, cond, shapes, x, t, target_shape=target)
    branch = ours.new_branch(build_layout(mask, shapes, target))
    ours.prefill(branch, embeds, cond)
    got = ours.decode(branch, x, t)
    without = reference_velocity(reference_dit(), embeds, mask, cond, shapes, x, t, target_shape=target)
    assert (got - expected).abs().max() <= 1e-5
    assert (got - without).abs().max() > 1e-2  # the LoRA changes the velocity
