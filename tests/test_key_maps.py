"""key_maps.py: ComfyUI <-> diffusers/transformers names, round trips, gate_up split, 5-D VAE weights."""

import pytest
import torch
from qwen21_nodes.qwen21_core.checkpoints import key_maps
from qwen21_nodes.qwen21_core.checkpoints.files import Layout
from qwen21_nodes.qwen21_core.config import VAEConfig
from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER, TINY_VAE, tiny_transformer_state_dict, tiny_vae_state_dict
from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE


def _apply(convert, state_dict):
    out = {}
    for key, tensor in state_dict.items():
        for name, value in convert(key, tensor):
            assert name not in out, f"{name} produced twice"
            out[name] = value
    return out


@pytest.fixture(scope="module")
def dit():
    torch.manual_seed(0)
    return tiny_transformer_state_dict()


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return tiny_vae_state_dict()


# ---- transformer --------------------------------------------------------------------------------------


def test_dit_comfyui_round_trip(dit):
    comfy = key_maps.dit_to_comfyui(dit)
    assert all(k.startswith("model.diffusion_model.") for k in comfy)
    assert len(comfy) == len(dit) - TINY_TRANSFORMER.num_layers  # one fused tensor per block instead of two
    back = _apply(key_maps.converter(Layout("transformer", "comfyui", "model.diffusion_model."), comfy), comfy)
    assert back.keys() == dit.keys()
    assert all(torch.equal(back[k], dit[k]) for k in dit)


def test_gate_up_is_gate_rows_first_and_split_as_views():
    hidden, dim = 6, 4
    gate, up = torch.full((hidden, dim), 1.0), torch.full((hidden, dim), 2.0)
    fused = key_maps.dit_to_comfyui({"transformer_blocks.3.img_mlp.gate_layer.weight": gate,
                                     "transformer_blocks.3.img_mlp.proj.weight": up})  # fmt: skip
    tensor = fused["model.diffusion_model.transformer_blocks.3.img_mlp.gate_up.weight"]
    assert tensor.shape == (2 * hidden, dim)
    assert torch.equal(tensor[:hidden], gate) and torch.equal(tensor[hidden:], up)  # gate rows first

    convert = key_maps.converter(Layout("transformer", "comfyui", "model.diffusion_model."), fused)
    (gate_name, gate_view), (up_name, up_view) = convert("model.diffusion_model.transformer_blocks.3." +
                                                         "img_mlp.gate_up.weight", tensor)  # fmt: skip
    assert (gate_name, up_name) == ("transformer_blocks.3.img_mlp.gate_layer.weight",
                                    "transformer_blocks.3.img_mlp.proj.weight")  # fmt: skip
    assert torch.equal(gate_view, gate) and torch.equal(up_view, up)
    assert gate_view.data_ptr() == tensor.data_ptr()  # views, not copies
    assert up_view.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


def test_dit_converter_strips_prefix_from_diffusers_names(dit):
    prefixed = {"model.diffusion_model." + k: v for k, v in dit.items()}
    back = _apply(key_maps.converter(Layout("transformer", "diffusers", "model.diffusion_model."), prefixed), prefixed)
    assert back.keys() == dit.keys()


# ---- VAE ----------------------------------------------------------------------------------------------

# Name pairs read off ComfyUI's Wan 2.2 module tree (comfy/ldm/wan/vae2_2.py: Encoder3d/Decoder3d/WanVAE) for
# num_res_blocks=2: the encoder stages hold [res, res, Resample], the decoder stages [res, res, res, Resample].
KNOWN_VAE_PAIRS = [
    ("conv1.weight", "quant_conv.weight"),
    ("conv2.bias", "post_quant_conv.bias"),
    ("encoder.conv1.weight", "encoder.conv_in.weight"),
    ("encoder.downsamples.0.downsamples.0.residual.0.gamma", "encoder.down_blocks.0.resnets.0.norm1.gamma"),
    ("encoder.downsamples.1.downsamples.0.shortcut.weight", "encoder.down_blocks.1.resnets.0.conv_shortcut.weight"),
    ("encoder.downsamples.1.downsamples.1.residual.6.bias", "encoder.down_blocks.1.resnets.1.conv2.bias"),
    ("encoder.downsamples.1.downsamples.2.resample.1.weight", "encoder.down_blocks.1.downsampler.resample.1.weight"),
    ("encoder.downsamples.1.downsamples.2.time_conv.weight", "encoder.down_blocks.1.downsampler.time_conv.weight"),
    ("encoder.middle.1.to_qkv.weight", "encoder.mid_block.attentions.0.to_qkv.weight"),
    ("encoder.middle.2.residual.3.gamma", "encoder.mid_block.resnets.1.norm2.gamma"),
    ("encoder.head.0.gamma", "encoder.norm_out.gamma"),
    ("encoder.head.2.weight", "encoder.conv_out.weight"),
    ("decoder.conv1.bias", "decoder.conv_in.bias"),
    ("decoder.middle.0.residual.2.weight", "decoder.mid_block.resnets.0.conv1.weight"),
    ("decoder.upsamples.0.upsamples.2.residual.2.weight", "decoder.up_blocks.0.resnets.2.conv1.weight"),
    ("decoder.upsamples.0.upsamples.3.time_conv.bias", "decoder.up_blocks.0.upsampler.time_conv.bias"),
    ("decoder.upsamples.3.upsamples.3.resample.1.weight", "decoder.up_blocks.3.upsampler.resample.1.weight"),
    ("decoder.head.2.weight", "decoder.conv_out.weight"),
]


@pytest.mark.parametrize(("comfy", "diffusers"), KNOWN_VAE_PAIRS)
def test_vae_key_pairs(comfy, diffusers):
    assert key_maps.vae_key_to_diffusers(comfy, num_res_blocks=2) == diffusers
    assert key_maps.vae_key_to_comfyui(diffusers, num_res_blocks=2) == comfy


def test_vae_comfyui_round_trip_with_5d_weights(vae):
    comfy = key_maps.vae_to_comfyui(vae, TINY_VAE.num_res_blocks)
    assert len(comfy) == len(vae)
    # causal convs are 5-D with a temporal kernel of 1; the plain 2-D convs stay 4-D; norms keep their shape
    assert comfy["encoder.conv1.weight"].shape == (8, 4, 1, 3, 3)
    assert comfy["conv1.weight"].dim() == 5 and comfy["decoder.head.2.weight"].dim() == 5
    assert comfy["encoder.downsamples.1.downsamples.2.time_conv.weight"].dim() == 5
    assert comfy["encoder.downsamples.0.downsamples.2.resample.1.weight"].dim() == 4
    assert comfy["decoder.middle.1.proj.weight"].dim() == 4
    assert comfy["decoder.head.0.gamma"].shape == vae["decoder.norm_out.gamma"].shape

    assert key_maps.vae_num_res_blocks(comfy, "comfyui") == TINY_VAE.num_res_blocks
    back = _apply(key_maps.converter(Layout("vae", "comfyui"), comfy), comfy)
    assert back.keys() == vae.keys()
    assert all(torch.equal(back[k], vae[k]) for k in vae)


def test_vae_key_map_covers_the_released_model():
    """Every key of the full-size VAE (238, diffusers layout) maps to a distinct ComfyUI key and back."""
    with torch.device("meta"):
        model_keys = set(QwenImage21VAE(VAEConfig()).checkpoint_slots())
    assert len(model_keys) == 238
    comfy = {key_maps.vae_key_to_comfyui(k, 2) for k in model_keys}
    assert len(comfy) == 238
    assert all(not k.startswith(("encoder.down_blocks", "decoder.up_blocks", "quant_conv")) for k in comfy)
    assert {key_maps.vae_key_to_diffusers(k, 2) for k in comfy} == model_keys


# ---- text encoder -------------------------------------------------------------------------------------

TE_PAIRS = [
    ("model.layers.0.self_attn.q_proj.weight", "model.language_model.layers.0.self_attn.q_proj.weight"),
    ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
    ("model.norm.weight", "model.language_model.norm.weight"),
    ("model.lm_head.weight", "lm_head.weight"),
    ("visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.attn.qkv.weight"),
    ("visual.deepstack_merger_list.2.linear_fc1.bias", "model.visual.deepstack_merger_list.2.linear_fc1.bias"),
]


@pytest.mark.parametrize(("internal", "transformers_name"), TE_PAIRS)
def test_text_encoder_key_pairs(internal, transformers_name):
    assert key_maps.te_internal_to_transformers(internal) == transformers_name
    assert key_maps.te_transformers_to_internal(transformers_name) == internal


def test_text_encoder_round_trip_over_a_real_model():
    from qwen21_nodes.qwen21_core.text.tiny import build_tiny_text_encoder

    model, _ = build_tiny_text_encoder()
    names = list(model.state_dict())
    internal = [key_maps.te_transformers_to_internal(n) for n in names]
    assert len(set(internal)) == len(names)
    assert all(k.startswith(("model.", "visual.")) and not k.startswith("model.language_model.") for k in internal)
    convert = key_maps.converter(Layout("text_encoder", "comfyui-internal"), internal)
    assert [convert(k, torch.zeros(1))[0][0] for k in internal] == names
