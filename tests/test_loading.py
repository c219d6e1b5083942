"""loading.py: both layouts into identical modules, parity with diffusers/transformers loaders, configs from
shapes, fp8 files, tokenizer lookup, errors."""

import json
import shutil

import pytest
import torch
from qwen21_nodes.qwen21_core.checkpoints import loading
from qwen21_nodes.qwen21_core.checkpoints.files import CheckpointMismatchError, WrongModelError
from qwen21_nodes.qwen21_core.config import TransformerConfig, VAEConfig
from qwen21_nodes.qwen21_core.quant.plan import WeightFormats
from qwen21_nodes.qwen21_core.quant.slots import QuantSlot
from qwen21_nodes.qwen21_core.tiny import TURBO_SIGMAS, make_tiny
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def _single(tiny, **changes):
    return {"transformer": tiny["transformer"], "vae": tiny["vae"], "text_encoder": tiny["text_encoder"], **changes}


def _same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_layouts_load_into_identical_modules(tiny, dtype):
    folder = loading.load_components(tiny["diffusers"], "cpu", dtype)
    single = loading.load_components(_single(tiny), "cpu", dtype)
    assert folder.transformer.config == single.transformer.config
    assert folder.vae.config == single.vae.config
    _same_tensors(folder.transformer.state_dict(), single.transformer.state_dict())
    _same_tensors(folder.vae.state_dict(), single.vae.state_dict())
    _same_tensors(folder.text_encoder.model.state_dict(), single.text_encoder.model.state_dict())
    assert folder.transformer.dtype == dtype and folder.vae.dtype == dtype and single.text_encoder.dtype == dtype
    assert folder.scheduler_config == single.scheduler_config
    assert folder.sources["transformer"]["layout"] == "diffusers"
    assert single.sources["transformer"]["layout"] == single.sources["vae"]["layout"] == "comfyui"
    assert single.sources["transformer"]["config"] == "derived from tensor shapes"
    assert single.sources["text_encoder"]["config"].endswith("qwen3vl_tiny.json")


def test_weights_match_the_diffusers_loader(tiny):
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel

    ours = loading.load_components(_single(tiny), "cpu", torch.float32, load_text_encoder=False)
    ref_transformer = QwenImage21Transformer2DModel.from_pretrained(tiny["diffusers"] / "transformer")
    slots = {k: v.detach() for k, v in ours.transformer.checkpoint_slots().items()}
    _same_tensors(slots, ref_transformer.state_dict())
    ref_vae = AutoencoderKLQwenImage21.from_pretrained(tiny["diffusers"] / "vae")
    ours_vae = {k: v.detach() for k, v in ours.vae.checkpoint_slots().items() if v is not None}
    ref_vae_state = {k: v for k, v in ref_vae.state_dict().items() if "time_conv" not in k}
    _same_tensors(ours_vae, ref_vae_state)


def test_text_encoder_matches_the_transformers_loader(tiny):
    from qwen21_nodes.qwen21_core.text.encoder import Qwen21TextEncoder

    ours, info = loading.load_qwen3vl(tiny["text_encoder"], "cpu", torch.float32)
    reference = Qwen21TextEncoder.from_folder(tiny["diffusers"], device="cpu", dtype=torch.float32)
    _same_tensors(ours.model.state_dict(), reference.model.state_dict())
    buffers, ref_buffers = dict(ours.model.named_buffers()), dict(reference.model.named_buffers())
    _same_tensors(buffers, ref_buffers)  # rotary frequencies computed, not left uninitialised
    a, b = ours.encode_prompts(["A capybara"])[0], reference.encode_prompts(["A capybara"])[0]
    assert torch.equal(a.embeds, b.embeds)
    assert info["tokenizer"].endswith("qwen3vl_tiny")


def test_configs_derived_from_shapes_equal_the_config_files(tiny):
    folder = tiny["diffusers"]
    expected_dit = TransformerConfig.from_json_file(folder / "transformer" / "config.json")
    expected_vae = VAEConfig.from_json_file(folder / "vae" / "config.json")
    transformer, _ = loading.load_transformer(tiny["transformer"], "cpu", torch.float32)
    vae, _ = loading.load_vae(tiny["vae"], "cpu", torch.float32)
    assert transformer.config == expected_dit
    assert vae.config == expected_vae


def test_released_rotary_split_is_derived_for_128_wide_heads():
    shapes = {
        "img_in.weight": (4096, 64),
        "proj_out.weight": (64, 4096),
        "txt_in.in_layer.weight": (4096, 4096),
        "transformer_blocks.0.attn.norm_q.weight": (128,),
        "transformer_blocks.0.attn.to_q.weight": (4096, 4096),
        "transformer_blocks.0.img_mlp.proj.weight": (12288, 4096),
    }
    shapes.update({f"transformer_blocks.{i}.attn.to_q.weight": (4096, 4096) for i in range(32)})
    assert loading.transformer_config_from_shapes(shapes) == TransformerConfig()  # the released defaults


def test_released_vae_config_is_derived_from_its_shapes():
    from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE

    with torch.device("meta"):
        model = QwenImage21VAE(VAEConfig())
    shapes = {k: tuple(v.shape) for k, v in model.checkpoint_slots().items() if v is not None}
    shapes.update(model.dropped_checkpoint_keys())
    assert len(shapes) == 238
    assert loading.vae_config_from_shapes(shapes) == VAEConfig()  # the released defaults


def test_diffusers_layout_single_files_and_unprefixed_comfy_files(tiny, tmp_path):
    comfy = load_file(tiny["transformer"])
    unprefixed = {k.removeprefix("model.diffusion_model."): v for k, v in comfy.items()}
    save_file(unprefixed, tmp_path / "dit_unprefixed.safetensors")
    shutil.copy(
        tiny["diffusers"] / "vae" / "diffusion_pytorch_model.safetensors", tmp_path / "vae_diffusers.safetensors"
    )
    reference = loading.load_components(tiny["diffusers"], "cpu", torch.float32, load_text_encoder=False)
    single = loading.load_components(
        {"transformer": tmp_path / "dit_unprefixed.safetensors", "vae": tmp_path / "vae_diffusers.safetensors"},
        "cpu", torch.float32, load_text_encoder=False,
    )  # fmt: skip
    _same_tensors(reference.transformer.state_dict(), single.transformer.state_dict())
    _same_tensors(reference.vae.state_dict(), single.vae.state_dict())
    assert single.sources["vae"]["layout"] == "diffusers" and single.sources["transformer"]["layout"] == "comfyui"


def test_fp8_scaled_comfy_transformer_loads_within_fp8_error(tiny, tmp_path):
    comfy = load_file(tiny["transformer"])
    quantized = {}
    for key, tensor in comfy.items():
        if key.endswith(".weight") and tensor.dim() == 2:  # ComfyUI quantises the linear weights only
            scale = tensor.abs().amax().float() / 448.0
            quantized[key] = (tensor / scale).to(torch.float8_e4m3fn)
            layer = key.removesuffix(".weight")
            quantized[layer + ".weight_scale"] = scale
            quantized[layer + ".comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
        else:
            quantized[key] = tensor.bfloat16()
    save_file(quantized, tmp_path / "dit_fp8_scaled.safetensors")

    reference, _ = loading.load_transformer(tiny["transformer"], "cpu", torch.float32)
    path = tmp_path / "dit_fp8_scaled.safetensors"
    for weight_format in ("auto", "none"):  # kept in fp8 (the file's format), or dequantised to fp32
        model, info = loading.load_transformer(path, "cpu", torch.float32, weight_formats=WeightFormats(weight_format))
        assert info["stored"] == "fp8 e4m3fn, scaled"
        assert info["weights"] == ("fp8 (8/8 block linears)" if weight_format == "auto" else "float32")
        for name, expected in reference.checkpoint_slots().items():
            got = model.checkpoint_slots()[name]
            got = got.dequantized() if isinstance(got, QuantSlot) else got
            assert (got - expected).abs().max() <= expected.abs().max() / 16 + 1e-6, name


# ---- tokenizer lookup ---------------------------------------------------------------------------------


def test_tokenizer_found_next_to_the_file_explicitly_and_in_a_comfyui_install(tiny, tmp_path):
    assert loading.find_tokenizer(tiny["text_encoder"]) == tiny["tokenizer"].resolve()
    assert loading.find_tokenizer(tiny["diffusers"] / "text_encoder") == (tiny["diffusers"] / "processor").resolve()
    assert loading.find_tokenizer(tiny["text_encoder"], explicit=tiny["diffusers"]) == tiny["diffusers"] / "processor"

    # A ComfyUI installation: models/text_encoders/<file>, the tokenizer in comfy/text_encoders/qwen25_tokenizer
    install = tmp_path / "ComfyUI"
    (install / "models" / "text_encoders").mkdir(parents=True)
    file = shutil.copy(tiny["text_encoder"], install / "models" / "text_encoders" / "qwen3vl.safetensors")
    bundled = install / loading.COMFYUI_TOKENIZER_DIR
    bundled.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # tokenizer files only, as ComfyUI bundles them
        shutil.copy(tiny["tokenizer"] / name, bundled / name)
    assert loading.find_tokenizer(file) == bundled.resolve()

    processor = loading.load_processor(bundled)
    assert processor.image_processor.patch_size == 16 and processor.image_processor.merge_size == 2
    assert processor.image_processor.size["shortest_edge"] == 65536  # Qwen3-VL's 256x256 minimum
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") is not None


def test_tokenizer_not_found_lists_where_it_looked(tiny, tmp_path):
    lonely = shutil.copy(tiny["text_encoder"], tmp_path / "te.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no Qwen3-VL tokenizer found .*te\.safetensors.*qwen25_tokenizer"):
        loading.find_tokenizer(lonely)
    with pytest.raises(FileNotFoundError, match="has no tokenizer files"):
        loading.find_tokenizer(lonely, explicit=tmp_path)


# ---- turbo, errors ------------------------------------------------------------------------------------


def test_turbo_folder_carries_its_sample_sigmas(tiny):
    turbo = loading.load_components(tiny["diffusers_turbo"], "cpu", torch.float32, load_text_encoder=False)
    assert turbo.pipeline_config.sample_sigmas == TURBO_SIGMAS
    plain = loading.load_components(tiny["diffusers"], "cpu", torch.float32, load_text_encoder=False)
    assert plain.pipeline_config.sample_sigmas is None


def test_wrong_pipeline_and_component_classes(tiny, tmp_path):
    folder = shutil.copytree(tiny["diffusers"], tmp_path / "folder")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": "QwenImageEditPlusPipeline"}))
    with pytest.raises(WrongModelError, match=r"found a Qwen-Image 1\.x pipeline \(QwenImageEditPlusPipeline\)"):
        loading.load_components(folder, "cpu", torch.float32)
    (folder / "model_index.json").write_text(json.dumps(index))
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, "_class_name": "WanTransformer3DModel"}))
    with pytest.raises(
        WrongModelError, match="expected a QwenImage21Transformer2DModel config, found WanTransformer3D"
    ):
        loading.load_components(folder, "cpu", torch.float32)
    shutil.rmtree(folder / "vae")
    with pytest.raises(FileNotFoundError, match=r"vae not found: the diffusers folder is incomplete"):
        loading.load_components(folder, "cpu", torch.float32)


def test_source_errors(tiny):
    with pytest.raises(ValueError, match="is a file; pass a diffusers folder"):
        loading.load_components(tiny["transformer"], "cpu", torch.float32)
    with pytest.raises(ValueError, match=r"needs paths for \['vae'\]"):
        loading.load_components({"transformer": tiny["transformer"], "text_encoder": tiny["text_encoder"]},
                                "cpu", torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown entries \['unet'\]"):
        loading.load_components(_single(tiny, unet="x"), "cpu", torch.float32)
    with pytest.raises(TypeError, match="dtype must be one of"):
        loading.load_components(_single(tiny), "cpu", torch.int8)
    with pytest.raises(FileNotFoundError, match="model_index.json not found"):
        loading.load_components(tiny["models"], "cpu", torch.float32)


def test_swapped_files_are_named(tiny):
    with pytest.raises(WrongModelError, match="this file is the Qwen-Image-2.1 VAE; load it as the vae"):
        loading.load_components(_single(tiny, transformer=tiny["vae"], vae=tiny["transformer"]), "cpu", torch.float32)


def test_text_encoder_of_another_size_needs_its_config(tiny, tmp_path):
    lonely = shutil.copy(tiny["text_encoder"], tmp_path / "qwen3vl_small.safetensors")
    with pytest.raises(WrongModelError, match=r"hidden size 64 and 2 layers, but Qwen-Image-2.1 uses Qwen3-VL-8B "
                                              r"\(4096, 36\).*as qwen3vl_small\.json"):  # fmt: skip
        loading.load_qwen3vl(lonely, "cpu", torch.float32, tokenizer=tiny["tokenizer"])


def test_text_encoder_and_transformer_must_fit(tiny, tmp_path):
    from qwen21_nodes.qwen21_core.text.tiny import save_tiny_text_encoder

    save_tiny_text_encoder(tmp_path / "wide", hidden_size=96)
    wide = {"text_encoder": tmp_path / "wide" / "text_encoder", "tokenizer": tmp_path / "wide" / "processor"}
    with pytest.raises(ValueError, match="hidden size 96 but the transformer reads 64"):
        loading.load_components(_single(tiny, **wide), "cpu", torch.float32)


def test_shape_mismatch_names_key_and_shapes(tiny, tmp_path):
    comfy = load_file(tiny["transformer"])
    comfy["model.diffusion_model.transformer_blocks.1.attn.to_out.0.weight"] = torch.zeros(64, 60)
    save_file(comfy, tmp_path / "broken.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"transformer_blocks\.1\.attn\.to_out\.0\.weight: checkpoint "
                                                      r"\[64, 60\] vs model \[64, 64\]"):  # fmt: skip
        loading.load_transformer(tmp_path / "broken.safetensors", "cpu", torch.float32)


@pytest.mark.gpu
def test_cuda_load_matches_cpu_load(tiny, monkeypatch):
    from qwen21_nodes.qwen21_core.checkpoints import files as checkpoint

    monkeypatch.setattr(checkpoint, "_CHUNK_BYTES", 4096)  # many chunks per tensor: both pinned buffers in turn
    cpu = loading.load_components(_single(tiny), "cpu", torch.bfloat16)
    cuda = loading.load_components(_single(tiny), "cuda", torch.bfloat16)
    assert cuda.transformer.device.type == "cuda" and cuda.text_encoder.device.type == "cuda"
    for name in ("transformer", "vae"):
        gpu_state = {k: v.cpu() for k, v in getattr(cuda, name).state_dict().items()}
        _same_tensors(getattr(cpu, name).state_dict(), gpu_state)
    _same_tensors(
        cpu.text_encoder.model.state_dict(), {k: v.cpu() for k, v in cuda.text_encoder.model.state_dict().items()}
    )


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_quantised_text_encoder_multiplies_with_dequantised_weights(tiny, use_settings, fmt):
    """The text encoder's quantised layers keep bf16 activations (weight-only, see loading.py
    TEXT_ENCODER_QUANTIZES_ACTIVATIONS): even where W8A8 would run (here its CPU emulation), and closer to the
    float encoder than W8A8 on the same weights."""
    from qwen21_nodes.qwen21_core.quant.linear import QuantLinear

    use_settings(quant_gemm="emulate")
    load = dict(tokenizer=tiny["tokenizer"])
    float_encoder, _ = loading.load_qwen3vl(tiny["text_encoder"], "cpu", torch.float32, **load)
    encoder, info = loading.load_qwen3vl(tiny["text_encoder"], "cpu", torch.float32, **load,
                                         weight_formats=WeightFormats(text_encoder=fmt))  # fmt: skip
    layers = [m for m in encoder.model.modules() if isinstance(m, QuantLinear)]
    assert layers and info["weights"].startswith(fmt) and not any(m.quantize_activations for m in layers)

    def error(enc):
        got = enc.encode_prompts(["a red fox in the snow"], [])[0].embeds
        want = float_encoder.encode_prompts(["a red fox in the snow"], [])[0].embeds
        return ((got - want).norm() / want.norm()).item()

    weight_only = error(encoder)
    for layer in layers:
        layer.quantize_activations = True
    assert 0 < weight_only < error(encoder)


def test_text_encoder_load_restores_torch_init_and_reports_a_broken_tokenizer(tiny, tmp_path):
    """The text encoder is built with transformers' weight initialisation skipped (its weights come from the file
    next) and its processor is read in a thread while the weights stream: torch's init functions are torch's again
    afterwards, and a tokenizer that cannot be read fails the load with the tokenizer's error."""
    names = ("normal_", "zeros_", "ones_", "uniform_", "kaiming_uniform_", "trunc_normal_")
    before = {name: getattr(torch.nn.init, name) for name in names}
    loading.load_qwen3vl(tiny["text_encoder"], "cpu", torch.float32)
    assert {name: getattr(torch.nn.init, name) for name in names} == before
    broken = tmp_path / "tokenizer"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{ this is not a tokenizer")
    with pytest.raises(ValueError, match="Expecting property name"):  # its JSON, read in the processor's thread
        loading.load_qwen3vl(tiny["text_encoder"], "cpu", torch.float32, tokenizer=broken)


def test_a_config_that_does_not_fit_its_weights_is_refused_before_anything_is_built(tiny, tmp_path):
    """A downloaded folder's config.json (or a sidecar .json) claiming 100,000 layers sized the model first (58 s and
    4.8 GB before its refusal): it is checked against the weights' header now, and refused at once."""
    import time
    import tracemalloc

    folder = tmp_path / "transformer"
    shutil.copytree(tiny["diffusers"] / "transformer", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_layers": 100_000}))
    encoders = tmp_path / "text_encoders"
    shutil.copytree(tiny["text_encoder"].parent, encoders)
    sidecar = encoders / tiny["text_encoder"].with_suffix(".json").name
    data = json.loads(sidecar.read_text())
    data["text_config"]["num_hidden_layers"] = 20_000
    sidecar.write_text(json.dumps(data))
    tracemalloc.start()
    started = time.perf_counter()
    with pytest.raises(CheckpointMismatchError, match=r"does not fit .* num_layers 100000 \(the weights: 2"):
        loading.load_transformer(folder, "cpu", torch.float32)
    with pytest.raises(CheckpointMismatchError, match=r"does not fit the weights beside it: .* 20000 layers"):
        loading.load_qwen3vl(encoders / tiny["text_encoder"].name, "cpu", torch.float32)
    assert time.perf_counter() - started < 1.0
    assert tracemalloc.get_traced_memory()[1] < 100 * 2**20
    tracemalloc.stop()
