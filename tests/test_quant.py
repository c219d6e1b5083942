"""Quantised weights: the formats' arithmetic, QuantLinear's error per Linear, the fused block math, the
quantised DiT against its float self, and the loaders on files written the way Comfy-Org's are (CPU; the W8A8
GEMMs, graph replay and speed on the GPU: bench_dit and the marked tests here)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from dit_reference import CHANNELS, CONTEXT, prompt_mask
from quant_files import dequantized, quantized_state_dict, regular_hadamard
from qwen21_nodes.kernels.quantize_rows import ROTATION_GROUPS, hadamard, rotate
from qwen21_nodes.qwen21_core.checkpoints import key_maps, loading
from qwen21_nodes.qwen21_core.checkpoints.formats import UnsupportedQuantizationError
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit import quant_math
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.dit.transformer import QUANTIZABLE, QwenImage21Transformer, uniform_plan
from qwen21_nodes.qwen21_core.quant.linear import QuantLinear
from qwen21_nodes.qwen21_core.quant.plan import WeightFormats
from qwen21_nodes.qwen21_core.quant.weights import FORMATS, dequantize_weight, quantize_weight
from safetensors.torch import save_file

# A DiT small enough for a CPU but wide enough for ConvRot (in_features multiples of 256): 2 heads x 128.
SMALL = TransformerConfig(in_channels=CHANNELS, out_channels=CHANNELS, num_layers=2, attention_head_dim=128,
                          num_attention_heads=2, context_in_dim=CONTEXT, mlp_ratio=3)  # fmt: skip
# Relative error of one Linear on Gaussian data (the bounds: fp8 <= 4%, int8 <= 1.5%).
LINEAR_BOUNDS = {"fp8": 0.04, "int8": 0.015, "int8_convrot": 0.015}


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _small_dit(seed=0):
    torch.manual_seed(seed)
    model = QwenImage21Transformer(SMALL).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.copy_(1 + 0.1 * torch.randn_like(param)) if "text_norm" not in name else param.zero_()
    return model


# ---- formats --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", ROTATION_GROUPS)
def test_hadamard_is_comfy_kitchens_regular_hadamard(group):
    h = hadamard(group)
    assert torch.equal(h, regular_hadamard(group).float())  # the Kronecker power of H4, normalised, bit for bit
    assert torch.equal(h, h.T) and torch.allclose(h @ h, torch.eye(group), atol=1e-6)
    assert set(h.abs().unique().tolist()) == {group**-0.5}
    x = torch.randn(3, 2048, dtype=torch.float64)
    assert torch.allclose(rotate(rotate(x.float(), group), group).double(), x, atol=1e-5)


@pytest.mark.parametrize("size", [2, 8, 32, 128, 512])
def test_hadamard_sizes_that_are_not_powers_of_4_are_refused_as_comfy_kitchen_refuses_them(size):
    with pytest.raises(ValueError, match="power of 4"):
        hadamard(size)


@pytest.mark.parametrize("name", list(FORMATS))
def test_weight_round_trip_error(name):
    weight = torch.randn(300, 512) * torch.linspace(0.1, 3, 300)[:, None]  # rows of different magnitudes
    q, scale = quantize_weight(weight, FORMATS[name])
    assert q.dtype == FORMATS[name].storage and scale.shape == (300,)
    back = dequantize_weight(q, scale, FORMATS[name].rotation, torch.float32)
    row_error = (back - weight).norm(dim=1) / weight.norm(dim=1)
    assert row_error.max() < {"fp8": 0.035, "int8": 0.012, "int8_convrot": 0.012}[name]


def test_convrot_layers_narrower_than_a_group_are_not_rotated():
    layer = QuantLinear(100, 8, FORMATS["int8_convrot"])
    assert layer.fmt == FORMATS["int8"]  # as ComfyUI's converter: rotation only where in_features % 256 == 0


# ---- one Linear ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["weight_only", "emulate"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_quant_linear_error_per_linear(use_settings, backend, name):
    use_settings(quant_gemm=backend)
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(768, 512, generator=gen) / 512**0.5
    x = torch.randn(64, 512, generator=gen)
    layer = QuantLinear.from_weight(weight, FORMATS[name])
    error = _rel(layer(x), F.linear(x.double(), weight.double()))
    # weight-only keeps the activation exact: only the weight's rounding counts
    assert error < LINEAR_BOUNDS[name] * (0.8 if backend == "weight_only" else 1.0)
    assert error > 1e-4  # it really went through the quantised weight


def test_int8_and_convrot_agree_on_the_product_they_approximate(use_settings):
    use_settings(quant_gemm="emulate")
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(256, 512, generator=gen)
    x = torch.randn(32, 512, generator=gen)
    exact = F.linear(x, weight)
    plain, rotated = (QuantLinear.from_weight(weight, FORMATS[n])(x) for n in ("int8", "int8_convrot"))
    assert not torch.equal(plain, rotated)  # the rotation changes what is rounded ...
    assert _rel(rotated, exact) < 0.015 and _rel(plain, exact) < 0.015  # ... not what is computed


# ---- fused block math ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_fused_block_math_matches_the_unfused_quantised_ops(use_settings, name):
    use_settings(quant_gemm="emulate")  # the W8A8 arithmetic, as the GPU path computes it
    block = _small_dit().transformer_blocks[0]
    gen = torch.Generator().manual_seed(3)
    b, s, d = 2, 9, SMALL.inner_dim
    x = torch.randn(b, s, d, generator=gen)
    attn = torch.randn(b, s, d, generator=gen)
    scale1, gate1, scale2, gate2 = (1 + 0.2 * torch.randn(b, 1, d, generator=gen) for _ in range(4))
    layers = {
        path: QuantLinear.from_weight(layer.weight.detach(), FORMATS[name]) for path, layer in block.linears().items()
    }
    qkv, out, gate_up, down = (layers[p] for p in QUANTIZABLE)

    def norm(t, scale):
        return F.layer_norm(t, (d,), eps=block.eps) * scale

    fused_qkv = quant_math.modulated_qkv(x, scale1, qkv, block.eps)
    assert _rel(fused_qkv, qkv(norm(x, scale1))) < 1e-3  # same quantised layer, fused vs unfused activation
    fused = quant_math.attention_out_and_mlp(x, attn, gate1, scale2, gate2, out, gate_up, down, block.eps)
    mid = x + gate1 * out(attn)
    g, u = gate_up(norm(mid, scale2)).chunk(2, dim=-1)
    unfused = mid + gate2 * down(F.silu(g) * u)
    assert _rel(fused, unfused) < 1e-3
    # and the float block math they approximate
    weights = {p: l.weight for p, l in block.linears().items()}
    mid = x + gate1 * F.linear(attn, weights["attn.to_out"])
    g, u = F.linear(norm(mid, scale2), weights["img_mlp.gate_up"]).chunk(2, dim=-1)
    exact = mid + gate2 * F.linear(F.silu(g) * u, weights["img_mlp.out"])
    assert _rel(fused, exact) < 0.05


# ---- the quantised DiT ---------------------------------------------------------------------------------


def _velocity(model, seed=4, target=(4, 4)):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(4, 4)]
    mask = prompt_mask(6, shapes)
    layout = build_layout(mask, shapes, target)
    branch = model.new_branch(layout, 1)
    model.prefill(branch, torch.randn(mask.shape[0], CONTEXT, generator=gen), torch.randn(16, CHANNELS, generator=gen))
    return model.decode(branch, torch.randn(1, target[0] * target[1], CHANNELS, generator=gen), torch.tensor([0.4]))


def _psnr(a, b):
    return 10 * math.log10(b.abs().max().item() ** 2 / (a - b).pow(2).mean().item())


@pytest.mark.parametrize("backend", ["weight_only", "emulate"])
@pytest.mark.parametrize("name", list(FORMATS))
def test_quantized_dit_velocity_against_its_float_self(use_settings, backend, name):
    use_settings(quant_gemm=backend)
    model = _small_dit()
    with torch.inference_mode():
        reference = _velocity(model)
        quantized = model.quantized_copy(uniform_plan(FORMATS[name], SMALL.num_layers))
        assert quantized.quantization == f"{name} (8/8 block linears)"
        got = _velocity(quantized)
        kept = _velocity(model.quantized_copy(uniform_plan(FORMATS[name], 2, keep=("img_mlp.gate_up", "img_mlp.out"))))
    assert _psnr(got, reference) >= 30 and not torch.equal(got, reference)
    assert _psnr(kept, reference) >= _psnr(got, reference) - 1  # keeping the MLP in float does not hurt
    assert torch.equal(_velocity(model), reference)  # the float model shares tensors and is untouched


def test_quantize_linears_in_place_frees_the_float_weights():
    model = _small_dit()
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    model.quantize_linears(uniform_plan(FORMATS["int8"], SMALL.num_layers))
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    block_params = sum(layer.qweight.numel() for b in model.transformer_blocks for layer in b.linears().values())
    assert before - after == 3 * block_params - 4 * sum(  # fp32 -> int8 weights, plus one fp32 scale per row
        layer.out_features for b in model.transformer_blocks for layer in b.linears().values()
    )


# ---- loaders on Comfy-Org-format files -----------------------------------------------------------------


def _comfy_dit_file(tmp_path, model, fmt, group=256):
    comfy = key_maps.dit_to_comfyui({k: v.detach() for k, v in model.checkpoint_slots().items()})
    blocks = quantized_state_dict(comfy, lambda key, _: ".transformer_blocks." in key, fmt, group)
    path = tmp_path / f"qwen_image_2.1_{fmt}.safetensors"
    save_file(blocks, path)
    return path, blocks


@pytest.mark.parametrize(
    "fmt,group", [("int8_convrot", 256), ("int8_convrot", 64), ("int8_convrot", 16), ("int8_convrot", 4),
                  ("int8", 0), ("fp8", 0)],
)  # fmt: skip
def test_comfy_quantized_dit_file_loads_its_stored_values_exactly(tmp_path, fmt, group):
    model = _small_dit()
    path, stored = _comfy_dit_file(tmp_path, model, fmt, group)
    loaded, info = loading.load_transformer(path, "cpu", torch.float32)  # auto: the file's own format
    assert info["weights"] == f"{fmt} (8/8 block linears)"
    block = loaded.transformer_blocks[1]
    assert {layer.fmt.rotation for layer in block.linears().values()} == {group}  # the file's own group
    # to_k is rows [256, 512) of the fused QKV layer; gate_up is ComfyUI's own fused layout
    prefix = "model.diffusion_model.transformer_blocks.1."
    qkv, gate_up = block.attn.to_qkv, block.img_mlp.gate_up
    assert torch.equal(qkv.qweight[256:512].view(torch.uint8), stored[prefix + "attn.to_k.weight"].view(torch.uint8))
    assert torch.equal(gate_up.qweight.view(torch.uint8), stored[prefix + "img_mlp.gate_up.weight"].view(torch.uint8))
    assert torch.equal(qkv.weight_scale[256:512], stored[prefix + "attn.to_k.weight_scale"].reshape(-1).expand(256))
    # and each layer means what ComfyUI would compute from the file
    conf = {"convrot": fmt == "int8_convrot", "convrot_groupsize": group}
    want = dequantized(stored[prefix + "img_mlp.out.weight"], stored[prefix + "img_mlp.out.weight_scale"], conf)
    assert torch.allclose(block.img_mlp.out.float_weight(torch.float64), want, atol=1e-6)
    float_weight = model.transformer_blocks[1].img_mlp.out.weight.double()
    assert _rel(want, float_weight) < {"fp8": 0.04, "int8": 0.012, "int8_convrot": 0.012}[fmt]


@pytest.mark.parametrize("group,backend", [(256, "weight_only"), (64, "weight_only"), (64, "emulate"), (4, "emulate")])
def test_comfy_int8_convrot_dit_file_samples_on_cpu(tmp_path, use_settings, group, backend):
    """weight_only rotates each weight back; emulate is the W8A8 arithmetic of the GPU path, activations rotated
    by the quantiser in the file's group: either way the velocity is the float model's, to int8 rounding."""
    use_settings(quant_gemm=backend)
    model = _small_dit()
    path, _ = _comfy_dit_file(tmp_path, model, "int8_convrot", group)
    loaded, _ = loading.load_transformer(path, "cpu", torch.float32)
    dequantized_model, info = loading.load_transformer(path, "cpu", torch.float32, weight_formats=WeightFormats("none"))
    assert info["weights"] == "float32"
    with torch.inference_mode():
        reference = _velocity(model)
        int8 = _velocity(loaded)
        assert _psnr(int8, reference) >= 30
        if backend == "weight_only":
            assert torch.allclose(int8, _velocity(dequantized_model), atol=1e-4)  # same weights, other arithmetic


def test_explicit_formats_requantise_or_quantise(tmp_path):
    model = _small_dit()
    path, _ = _comfy_dit_file(tmp_path, model, "int8_convrot")
    as_fp8, info = loading.load_transformer(path, "cpu", torch.float32, weight_formats=WeightFormats("fp8"))
    assert info["weights"] == "fp8 (8/8 block linears)"
    kept, info = loading.load_transformer(path, "cpu", torch.float32,
                                          weight_formats=WeightFormats("int8", keep=("img_mlp.gate_up",)))  # fmt: skip
    assert info["weights"] == "int8 (6/8 block linears)"
    assert not isinstance(kept.transformer_blocks[0].img_mlp.gate_up, QuantLinear)
    with torch.inference_mode():
        assert _psnr(_velocity(as_fp8), _velocity(model)) >= 28


@pytest.mark.parametrize(
    "conf,message",
    [
        ({"format": "nvfp4"}, r"format \['nvfp4'\]"),
        ({"format": "convrot_w4a4", "convrot_groupsize": 256}, r"format \['convrot_w4a4'\]"),
        ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 128}, r"group size 128 .*4, 16, 64"),
        ({"format": "int8_tensorwise", "convrot": True, "convrot_groupsize": 4096}, r"group size 4096 .*256, 1024"),
    ],
)
def test_formats_we_cannot_run_are_named_with_what_to_use(tmp_path, conf, message):
    from quant_files import marker

    model = _small_dit()
    comfy = key_maps.dit_to_comfyui({k: v.detach() for k, v in model.checkpoint_slots().items()})
    key = "model.diffusion_model.transformer_blocks.0.img_mlp.out"
    comfy[key + ".weight"] = torch.zeros_like(comfy[key + ".weight"], dtype=torch.int8)
    comfy[key + ".weight_scale"] = torch.ones(comfy[key + ".weight"].shape[0], 1)
    comfy[key + ".comfy_quant"] = marker(conf)
    save_file(comfy, tmp_path / "odd.safetensors")
    with pytest.raises(UnsupportedQuantizationError, match=message + r".*int8_convrot release of the file instead"):
        loading.load_transformer(tmp_path / "odd.safetensors", "cpu", torch.float32)


# ---- GPU: the W8A8 GEMMs and graph replay --------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none (run on the H200)")
@pytest.mark.parametrize("name", list(FORMATS))
def test_w8a8_on_the_gpu_matches_its_emulation_and_replays_bit_identically(use_settings, name):
    from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs

    model = _small_dit().to("cuda", torch.bfloat16)
    quantized = model.quantized_copy(uniform_plan(FORMATS[name], SMALL.num_layers))
    layer = quantized.transformer_blocks[0].img_mlp.gate_up
    assert layer.backend(4096) != "weight_only", "this GPU should run the W8A8 GEMM"
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, SMALL.inner_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    gpu = layer(x).float()
    use_settings(quant_gemm="emulate")
    emulated = layer(x).float()
    use_settings(quant_gemm=None)
    assert _rel(gpu, emulated) < 5e-3  # same quantised operands; bf16 output and fp32 accumulation order differ

    shapes = [(4, 4)]
    mask = prompt_mask(6, shapes)
    layout = build_layout(mask, shapes, (8, 8))  # 64 target rows: _int_mm needs more than 16
    embeds = torch.randn(mask.shape[0], CONTEXT, device="cuda", generator=gen, dtype=torch.bfloat16)
    cond = torch.randn(16, CHANNELS, device="cuda", generator=gen, dtype=torch.bfloat16)
    latents = torch.randn(1, 64, CHANNELS, device="cuda", generator=gen, dtype=torch.bfloat16)
    t = torch.tensor([0.4], device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        graphs = DecodeGraphs(quantized, launch_bound_share=0)
        branch = graphs.new_branch(layout, 1)
        quantized.prefill(branch, embeds, cond)
        replayed = graphs(branch, latents, t)
        replayed_again = graphs(branch, latents, t)
        eager = quantized.decode(branch, latents, t, in_graph=True)
        assert graphs.describe() == "replay"
        assert torch.equal(replayed, eager) and torch.equal(replayed_again, eager)
        reference_branch = model.new_branch(layout, 1)
        model.prefill(reference_branch, embeds, cond)
        assert _psnr(eager.float(), model.decode(reference_branch, latents, t).float()) >= 30
