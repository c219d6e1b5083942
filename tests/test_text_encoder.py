"""Qwen21TextEncoder against diffusers' QwenImage21Pipeline.encode_prompt, on the tiny offline fixture."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import QwenImage21Pipeline  # noqa: E402
from PIL import Image  # noqa: E402
from qwen21_nodes.qwen21_core.text.encoder import (  # noqa: E402
    QWEN3_VL_8B_CONFIG,
    Qwen21TextEncoder,
    build_prompt_text,
)
from qwen21_nodes.qwen21_core.text.tiny import (  # noqa: E402
    build_tiny_text_encoder,
    load_tiny_text_encoder,
    save_tiny_text_encoder,
)
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor  # noqa: E402

PROMPT = "A capybara wearing a wizard hat"


@pytest.fixture(scope="module")
def tiny():
    model, processor = build_tiny_text_encoder(seed=0)
    reference = QwenImage21Pipeline(scheduler=None, vae=None, text_encoder=model, processor=processor, transformer=None)
    return model, processor, reference


@pytest.fixture(scope="module")
def encoder(tiny):
    model, processor, _ = tiny
    return Qwen21TextEncoder(model, processor)


def _rgb_images(count):
    rng = np.random.default_rng(count)
    sizes = [(64, 96), (96, 64), (64, 64), (32, 128)]  # (height, width), multiples of 32 as prepared
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % 4], 3), dtype=np.uint8)) for i in range(count)]


def test_template_places_space_separated_image_blocks_after_the_user_header():
    text = build_prompt_text("hello", 2)
    user_turn = text.split("<|im_start|>")[2]
    assert user_turn == (
        "user\n<image1><|vision_start|><|image_pad|><|vision_end|> "
        "<image2><|vision_start|><|image_pad|><|vision_end|>hello<|im_end|>\n"
    )
    assert "<image" not in build_prompt_text("hello", 0)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("num_images", [0, 1, 2, 4])
@pytest.mark.parametrize("prompt", [PROMPT, ""])
def test_matches_reference_encode_prompt_fp32(tiny, encoder, num_images, prompt):
    _, _, reference = tiny
    images = _rgb_images(num_images)
    ours = encoder.encode_prompts([prompt, "blurry, low quality"], images)
    for text, embedding in zip([prompt, "blurry, low quality"], ours, strict=True):
        embeds, mask, image_pad_mask = reference.encode_prompt(text, image=images or None, device="cpu")
        assert mask is None  # batch 1: nothing padded
        assert embedding.embeds.dtype == torch.float32
        assert torch.equal(embedding.embeds, embeds[0])
        assert torch.equal(embedding.image_pad_mask, image_pad_mask[0])
    expected_slots = sum((im.height // 32) * (im.width // 32) for im in images)
    assert all(int(e.image_pad_mask.sum()) == expected_slots for e in ours)


def test_embedding_is_the_last_decoder_layer_before_the_final_norm(tiny, encoder):
    model, processor, _ = tiny
    captured = {}
    handle = model.model.language_model.layers[-1].register_forward_hook(
        lambda module, args, output: captured.setdefault(
            "last_layer", output[0] if isinstance(output, tuple) else output
        )
    )
    try:
        (embedding,) = encoder.encode_prompts([PROMPT])
    finally:
        handle.remove()
    last_layer = captured["last_layer"][0]
    assert torch.equal(embedding.embeds, last_layer[-embedding.length :])
    # ...and not the normed output the model returns without the hook.
    inputs = processor(text=[build_prompt_text(PROMPT, 0)], return_tensors="pt")
    with torch.no_grad():
        normed = model.model(**inputs).last_hidden_state[0]
    assert not torch.allclose(embedding.embeds, normed[-embedding.length :])


def test_the_encoders_attention_never_runs_on_cudnn(tiny, encoder):
    """Every changed prompt is a new length; SDPA's cuDNN kernel plans each new shape on the host (37-67 ms a prompt on
    the H200), so the encoder's forward runs with it switched off, and the flags are restored afterwards."""
    model, _, _ = tiny
    seen = []
    layer = model.model.language_model.layers[0]
    handle = layer.register_forward_pre_hook(lambda module, args: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        encoder.encode_prompts([PROMPT])
    finally:
        handle.remove()
    assert seen == [False]
    assert torch.backends.cuda.cudnn_sdp_enabled() == before


def test_system_turn_is_dropped_up_to_the_second_im_start(tiny, encoder):
    _, processor, reference = tiny
    (embedding,) = encoder.encode_prompts([PROMPT])
    ids = processor.tokenizer(build_prompt_text(PROMPT, 0))["input_ids"]
    assert embedding.length == len(ids) - reference._drop_idx
    im_start = processor.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[len(ids) - embedding.length] == im_start  # the kept part starts with the user turn


@pytest.mark.parametrize("num_images", [0, 2])
def test_count_tokens_predicts_the_embedding_length(encoder, num_images):
    images = _rgb_images(num_images)
    pads = [(im.height // 32) * (im.width // 32) for im in images]
    (embedding,) = encoder.encode_prompts([PROMPT], images)
    assert encoder.count_tokens(PROMPT, pads) == embedding.length
    assert encoder.count_tokens("", []) == encoder.encode_prompts([""])[0].length


def test_activation_estimate_counts_tokens_and_a_dequantised_weight(tiny, encoder):
    """What the encoder asks the memory manager to leave free: per token, 36 hidden-sized vectors; with weight-only
    quantised layers also the biggest weight's fp32 product and its bf16 copy (at 24 GB the encode ran out of
    memory allocating exactly that fp32 product, 192 MiB for a 12288x4096 weight)."""
    from qwen21_nodes.qwen21_core.quant.linear import quantize_linears_
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS
    from qwen21_nodes.qwen21_core.text.encoder import decoder_linear_names

    per_token = 36 * encoder.hidden_size * encoder.dtype.itemsize
    assert encoder.activation_bytes(10) == 10 * per_token
    assert encoder.estimated_tokens(PROMPT, 2, 256) >= encoder.count_tokens(PROMPT, [64, 64]) + 12  # + system turn
    model, processor, _ = tiny
    names = decoder_linear_names(model.model)
    biggest = max(model.model.get_submodule(n).weight.numel() for n in names)
    for quantize_activations, extra in ((False, biggest * (4 + encoder.dtype.itemsize)), (True, 0)):
        quantised = copy.deepcopy(model.model)
        quantize_linears_(quantised, names, FORMATS["fp8"], quantize_activations)
        assert Qwen21TextEncoder(quantised, processor).activation_bytes(10) == 10 * per_token + extra


def test_image_pad_count_follows_the_processor_limits(encoder):
    assert encoder.image_pad_count(96, 64) == 6
    min_pixels, _ = encoder.pixel_limits()
    assert min_pixels == 32 * 32
    small = copy.deepcopy(encoder.processor)
    small.image_processor.size = {"shortest_edge": 256 * 256, "longest_edge": 4096 * 4096}
    assert Qwen21TextEncoder(encoder.model, small).image_pad_count(96, 64) > 6  # the processor upscales


def test_encode_runs_in_the_model_dtype(tiny, encoder):
    model, processor, _ = tiny
    bf16 = Qwen21TextEncoder(copy.deepcopy(model).to(torch.bfloat16), processor)
    assert bf16.dtype == torch.bfloat16
    (low,) = bf16.encode_prompts([PROMPT], _rgb_images(1))
    (high,) = encoder.encode_prompts([PROMPT], _rgb_images(1))
    assert low.embeds.dtype == torch.bfloat16
    assert torch.equal(low.image_pad_mask, high.image_pad_mask)
    torch.testing.assert_close(low.embeds.float(), high.embeds, atol=0.1, rtol=0.05)


def test_bad_inputs_get_clear_errors(tiny, encoder):
    model, processor, _ = tiny
    with pytest.raises(TypeError, match="prompts must be a list of str"):
        encoder.encode_prompts(PROMPT)
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a str, got int"):
        encoder.encode_prompts([PROMPT, 3])
    rgba = Image.new("RGBA", (64, 64))
    with pytest.raises(TypeError, match=r"vlm_images\[0\] must be an RGB PIL image .*RGBA"):
        encoder.encode_prompts([PROMPT], [rgba])
    with pytest.raises(TypeError, match="model must be a transformers Qwen3VL"):
        Qwen21TextEncoder(torch.nn.Linear(2, 2), processor)
    with pytest.raises(TypeError, match="processor must be a transformers Qwen3VLProcessor"):
        Qwen21TextEncoder(model, object())


def test_offload_points_the_weights_at_their_host_copy_made_once(tiny):
    """Off the device the weights are views of the encoder's host copy (pinned where CUDA exists), made at the first
    move there and kept: the next one copies nothing (the weights did not change) and encoding still agrees. (On a
    CPU-only machine the CPU is both devices; `place` still goes through the host copy.)"""
    model, processor, _ = tiny
    (want,) = Qwen21TextEncoder(copy.deepcopy(model), processor).encode_prompts([PROMPT])
    encoder = Qwen21TextEncoder(copy.deepcopy(model), processor)
    encoder.place(encoder.offload_device)
    (first,) = encoder.encode_prompts([PROMPT])
    home = encoder.host_copy
    assert home is not None and home.flats and home.nbytes >= sum(p.numel() * p.element_size()
                                                                   for p in encoder.model.parameters())  # fmt: skip
    layer_weights = {p.data_ptr() for layer in encoder._text_model.layers for p in layer.parameters()}
    flat_ranges = [(f.data_ptr(), f.data_ptr() + f.numel()) for f in home.flats.values()]
    assert all(any(lo <= ptr < hi for lo, hi in flat_ranges) for ptr in layer_weights)
    buffers = {index: flat.data_ptr() for index, flat in home.flats.items()}
    encoder.place(encoder.offload_device)
    (second,) = encoder.encode_prompts([PROMPT])
    assert {index: flat.data_ptr() for index, flat in encoder.host_copy.flats.items()} == buffers  # kept, not remade
    assert torch.equal(first.embeds, want.embeds) and torch.equal(second.embeds, want.embeds)


def test_folder_round_trip_and_configurable_hidden_size(tmp_path, encoder):
    save_tiny_text_encoder(tmp_path / "ckpt", seed=0)
    assert (tmp_path / "ckpt/text_encoder/model.safetensors").is_file()
    assert not list((tmp_path / "ckpt").rglob("*.bin"))
    assert (tmp_path / "ckpt/processor/tokenizer.json").is_file()
    loaded = load_tiny_text_encoder(tmp_path / "ckpt")
    images = _rgb_images(1)
    assert torch.equal(
        loaded.encode_prompts([PROMPT], images)[0].embeds, encoder.encode_prompts([PROMPT], images)[0].embeds
    )
    assert loaded.identity == encoder.identity

    save_tiny_text_encoder(tmp_path / "narrow", hidden_size=32, seed=1)
    narrow = Qwen21TextEncoder.from_folder(tmp_path / "narrow", device="cpu", dtype=torch.float32)
    assert narrow.hidden_size == 32
    assert narrow.encode_prompts([PROMPT])[0].embeds.shape[-1] == 32
    assert narrow.identity != encoder.identity


def test_saved_folder_loads_with_the_classes_diffusers_uses(tmp_path):
    save_tiny_text_encoder(tmp_path)
    model = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "text_encoder")
    processor = Qwen3VLProcessor.from_pretrained(tmp_path / "processor")
    assert model.config.text_config.hidden_size == 64
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id


def test_from_folder_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="text_encoder"):
        Qwen21TextEncoder.from_folder(tmp_path)
    save_tiny_text_encoder(tmp_path)
    (tmp_path / "processor").rename(tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError, match="neither processor/ nor tokenizer/"):
        Qwen21TextEncoder.from_folder(tmp_path)


@pytest.mark.gpu
def test_offload_frees_cuda_memory_and_to_brings_it_back(tiny):
    model, processor, _ = tiny
    encoder = Qwen21TextEncoder(copy.deepcopy(model), processor).to("cuda")
    (before,) = encoder.encode_prompts([PROMPT])
    allocated = torch.cuda.memory_allocated()
    encoder.offload()
    assert next(encoder.model.parameters()).device.type == "cpu"
    assert torch.cuda.memory_allocated() < allocated
    encoder.offload_after_encode = True
    (after,) = encoder.encode_prompts([PROMPT])  # brings the weights back, then offloads again
    assert after.embeds.device.type == "cuda"
    assert torch.equal(before.embeds, after.embeds)
    assert next(encoder.model.parameters()).device.type == "cpu"


@pytest.mark.gpu
def test_an_encode_keeps_a_streaming_placement_on_the_gpu(tiny):
    """A memory manager's partial placement survives the encode when the encoder names its device "cuda" and the
    weights sit on "cuda:0" (the full-size encoder at a 16 GB cap was placed whole again here, out of memory)."""
    model, processor, _ = tiny
    (want,) = Qwen21TextEncoder(copy.deepcopy(model), processor).to("cuda").encode_prompts([PROMPT])
    encoder = Qwen21TextEncoder(copy.deepcopy(model), processor)
    encoder.place("cuda", 1)
    encoder.device = torch.device("cuda")  # named as the benchmark names it: no index
    (got,) = encoder.encode_prompts([PROMPT])
    assert encoder.streamer is not None and encoder.resident_layers == 1
    assert torch.equal(got.embeds, want.embeds)


def test_the_written_down_8b_config_has_the_released_parameter_count():
    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**copy.deepcopy(QWEN3_VL_8B_CONFIG)))
    assert sum(p.numel() for p in model.parameters()) == 8_767_123_696  # Qwen3-VL-8B: 8.77 B
    assert model.config.text_config.hidden_size == 4096  # = the DiT's context_in_dim


def test_weight_sizes_are_walked_once(tiny, monkeypatch):
    """The memory manager asks for the encoder's device bytes several times per encode, and the node for its
    activation bytes; walking its parameters each time took 48.2 ms of a traced encode on the H200 (BENCHMARKS
    "Session"). Both sizes are found once (the encoder's Linears are fixed once it is built)."""
    model, processor, _ = tiny
    encoder = Qwen21TextEncoder(model, processor)
    inner = encoder.model  # the Qwen3VLModel (no LM head)
    want = sum(p.numel() * p.element_size() for p in inner.parameters())
    walks = []

    def counted(name):
        real = getattr(type(inner), name)
        return lambda self, *args, **kwargs: walks.append(name) or real(self, *args, **kwargs)

    for name in ("parameters", "modules"):
        monkeypatch.setattr(type(inner), name, counted(name))
    assert [encoder.device_weight_bytes() for _ in range(3)] == [want] * 3
    first = encoder.activation_bytes(10)
    assert encoder.activation_bytes(10) == first and encoder.activation_bytes(20) > first
    assert sorted(walks) == ["modules", "parameters"]
