"""encode_conditioning against the reference QwenImage21Pipeline (its own preprocessing, encode_prompt and
prepare_latents, captured during a real __call__), plus the limits and checks around it.

The exact-parity tests put the reference VAE behind encode_conditioning's VAE interface, so they check this
module's part (image handling, normalisation, slot order) bit for bit; the rest use our QwenImage21VAE."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import AutoencoderKLQwenImage21, QwenImage21Pipeline  # noqa: E402
from PIL import Image  # noqa: E402
from qwen21_nodes.qwen21_core.config import TransformerConfig, VAEConfig  # noqa: E402
from qwen21_nodes.qwen21_core.dit.sequence import ROPE_MAX_POSITION, build_layout  # noqa: E402
from qwen21_nodes.qwen21_core.encoding import (  # noqa: E402
    PrefixMemoryBudget,
    PrefixMemoryError,
    check_prompt_length,
    encode_conditioning,
    encode_negative,
)
from qwen21_nodes.qwen21_core.text.encoder import Qwen21TextEncoder  # noqa: E402
from qwen21_nodes.qwen21_core.text.tiny import build_tiny_processor, build_tiny_text_encoder  # noqa: E402
from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE  # noqa: E402

Z_DIM = 16


class _StopAfterLatents(Exception):
    pass


class ReferenceVAEAdapter:
    """diffusers' AutoencoderKLQwenImage21 behind the interface encode_conditioning uses:
    encode([B, H, W, 4] in 0..1) -> raw latents (mode), normalize(raw) -> (raw - mean) / std."""

    def __init__(self, vae):
        self.vae = vae

    def encode(self, images):
        pixels = (2.0 * images.permute(0, 3, 1, 2) - 1.0).unsqueeze(2)  # [B, 4, 1, H, W] in -1..1
        return self.vae.encode(pixels).latent_dist.mode()[:, :, 0]

    def normalize(self, raw):
        mean = torch.tensor(self.vae.config.latents_mean).view(1, -1, 1, 1).to(raw)
        std = torch.tensor(self.vae.config.latents_std).view(1, -1, 1, 1).to(raw)
        return (raw - mean) / std


@pytest.fixture(scope="module")
def parts():
    model, processor = build_tiny_text_encoder(seed=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        vae = AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=12, z_dim=Z_DIM, dim_mult=[1, 2, 2, 2, 2], num_res_blocks=1,
            temperal_downsample=[False, True, True, True], latents_mean=torch.randn(Z_DIM).tolist(),
            latents_std=(torch.rand(Z_DIM) + 0.5).tolist(), in_channels=4, out_channels=4,
        ).eval()  # fmt: skip
    return model, processor, vae


@pytest.fixture(scope="module")
def encoder(parts):
    model, processor, _ = parts
    return Qwen21TextEncoder(model, processor)


@pytest.fixture(scope="module")
def vae(parts):
    """Our VAE with the reference VAE's weights."""
    reference = parts[2]
    ours = QwenImage21VAE(VAEConfig.from_dict(dict(reference.config)))
    ours.load_diffusers_state_dict(reference.state_dict())
    return ours.eval()


def reference_encode(parts, prompt, images, negative_prompt, output_resolution):
    """Run the reference pipeline's __call__ up to prepare_latents; return what it computed."""
    model, processor, vae = parts
    pipe = QwenImage21Pipeline(scheduler=None, vae=vae, text_encoder=model, processor=processor, transformer=None)
    pipe.transformer = types.SimpleNamespace(config=types.SimpleNamespace(in_channels=Z_DIM))
    captured = {"prompts": []}
    encode_prompt, prepare_latents = pipe.encode_prompt, pipe.prepare_latents

    def capture_prompt(*args, **kwargs):
        captured["prompts"].append(encode_prompt(*args, **kwargs))
        return captured["prompts"][-1]

    def capture_latents(images, batch_size, channels, height, width, *args, **kwargs):
        _, captured["image_latents"] = prepare_latents(images, batch_size, channels, height, width, *args, **kwargs)
        captured["size"] = (width, height)
        raise _StopAfterLatents

    pipe.encode_prompt, pipe.prepare_latents = capture_prompt, capture_latents
    with pytest.raises(_StopAfterLatents):
        pipe(prompt=prompt, image=images or None, negative_prompt=negative_prompt, true_cfg_scale=2.0,
             output_resolution=output_resolution, output_type="latent")  # fmt: skip
    return captured


def _random_image(height, width, mode, seed):
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    if mode == "RGBA":
        array[: height // 4, :, 3] = 0
    return Image.fromarray(array, mode)


IMAGE_SETS = {
    "t2i": [],
    "1 rgb": [("RGB", 50, 70)],
    "2 rgba+rgb": [("RGBA", 80, 45), ("RGB", 64, 64)],
    "4 mixed": [("RGB", 40, 90), ("RGBA", 64, 64), ("RGBA", 100, 60), ("RGB", 33, 70)],
}


def _images(name):
    return [_random_image(h, w, mode, seed) for seed, (mode, h, w) in enumerate(IMAGE_SETS[name])]


def _packed(cond):
    """Our per-image [z, h, w] latents packed like the reference: h*w rows of z, images one after another."""
    return torch.cat([latents.flatten(1).T for latents in cond.condition_latents])[None]


@pytest.mark.parametrize("name", list(IMAGE_SETS))
def test_identical_to_the_reference_pipeline_fp32(parts, encoder, name):
    images = _images(name)
    reference = reference_encode(parts, "make it blue", images, "blurry", 64)
    cond = encode_conditioning(
        encoder, ReferenceVAEAdapter(parts[2]), "make it blue", images, negative_prompt="blurry", output_resolution=64
    )
    assert cond.negative is None and cond.negative_pending.text == "blurry"  # encoded only when asked
    encode_negative(encoder, cond)

    for ours, (embeds, mask, image_pad_mask) in zip((cond.positive, cond.negative), reference["prompts"], strict=True):
        assert mask is None
        assert torch.equal(ours.embeds, embeds[0])
        assert torch.equal(ours.image_pad_mask, image_pad_mask[0])
    assert (cond.width, cond.height) == reference["size"]
    if images:
        assert torch.equal(_packed(cond), reference["image_latents"])
    else:
        assert cond.condition_latents == () and reference["image_latents"] is None
    assert cond.num_images == len(images)


def test_our_vae_gives_the_reference_condition_latents(parts, encoder, vae):
    images = _images("4 mixed")
    reference = reference_encode(parts, "make it blue", images, None, 64)
    cond = encode_conditioning(encoder, vae, "make it blue", images, output_resolution=64)
    # Not bit-identical: the reference hands diffusers' VAE a channels-last-strided tensor (numpy HWC ->
    # permuted view), whose CPU convolutions round differently (~5e-7) from the contiguous input ours uses.
    torch.testing.assert_close(_packed(cond), reference["image_latents"], atol=1e-5, rtol=1e-5)


def test_comfy_image_and_mask_inputs_match_the_reference_rgba(parts, encoder):
    rgba = _random_image(72, 40, "RGBA", seed=7)
    array = np.asarray(rgba)
    image = torch.from_numpy(array[..., :3].astype(np.float32) / 255.0)[None]  # LoadImage's IMAGE
    mask = 1.0 - torch.from_numpy(array[..., 3].astype(np.float32) / 255.0)[None]  # and MASK
    reference = reference_encode(parts, "swap the sky", [rgba], "blurry", 96)
    vae = ReferenceVAEAdapter(parts[2])
    cond = encode_conditioning(
        encoder, vae, "swap the sky", [image], masks=[mask], negative_prompt="blurry", output_resolution=96
    )
    encode_negative(encoder, cond)
    assert torch.equal(cond.positive.embeds, reference["prompts"][0][0][0])
    assert torch.equal(cond.negative.embeds, reference["prompts"][1][0][0])
    assert torch.equal(_packed(cond), reference["image_latents"])


def test_conditioning_fields_and_sizes(encoder, vae):
    images = [_random_image(60, 100, "RGB", 1), _random_image(90, 50, "RGBA", 2)]
    cond = encode_conditioning(encoder, vae, "a cat", images, output_resolution=64)
    assert cond.negative is None
    # 100x60 and 50x90 at area 64^2, sides rounded to multiples of 32.
    assert cond.extra["image_sizes"] == [(96, 64), (32, 96)]
    assert cond.image_shapes == [(64 // 16, 96 // 16), (96 // 16, 32 // 16)]
    assert all(latents.shape[0] == Z_DIM for latents in cond.condition_latents)
    assert (cond.width, cond.height) == (32, 96)  # the last image's aspect ratio
    assert cond.extra["source_sizes"] == [(100, 60), (50, 90)]
    expected_prefix = cond.positive.length + 3 * int(cond.positive.image_pad_mask.sum())
    assert cond.extra["prefix_tokens"] == {"positive": expected_prefix}
    sized = encode_conditioning(encoder, vae, "a cat", images, output_resolution=64, width=128, height=64)
    assert (sized.width, sized.height) == (128, 64)
    with pytest.raises(ValueError, match="width 100 is not a positive multiple of 32 .*use 96"):
        encode_conditioning(encoder, vae, "a cat", images, output_resolution=64, width=100)


def test_content_hash_changes_with_every_input(encoder, vae):
    image = _random_image(64, 64, "RGBA", 3)
    base = dict(images=[image], negative_prompt=None, output_resolution=64)
    reference_hash = encode_conditioning(encoder, vae, "a cat", **base).content_hash
    assert encode_conditioning(encoder, vae, "a cat", **base).content_hash == reference_hash
    changed_pixels = image.copy()
    changed_pixels.putpixel((0, 0), (1, 2, 3, 4))
    variants = [
        dict(base, prompt="a dog"),
        dict(base, negative_prompt=""),
        dict(base, images=[changed_pixels]),
        dict(base, output_resolution=96),
        dict(base, images=[]),
        dict(base, width=128),
    ]
    hashes = {encode_conditioning(encoder, vae, **{"prompt": "a cat", **variant}).content_hash for variant in variants}
    assert reference_hash not in hashes and len(hashes) == len(variants)


def test_a_vae_is_fingerprinted_once_and_another_vae_differs(vae, monkeypatch):
    """The content hash names the VAE by a fingerprint of its weights, read back from the device: taken once per VAE
    module, not at every encode; a VAE with other weights gets another."""
    import copy

    from qwen21_nodes.qwen21_core import encoding

    other = copy.deepcopy(vae)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    first = encoding._vae_identity(vae)
    reads = []
    real = type(vae).parameters
    monkeypatch.setattr(type(vae), "parameters", lambda self, *a, **k: reads.append(self) or real(self, *a, **k))
    assert encoding._vae_identity(vae) == first and reads == []  # kept
    assert encoding._vae_identity(other) != first and reads == [other]


def test_at_most_16_condition_images(encoder, vae):
    images = [Image.new("RGB", (32, 32))] * 17
    with pytest.raises(ValueError, match="got 17 condition images but at most 16 are accepted"):
        encode_conditioning(encoder, vae, "a cat", images, output_resolution=32)
    with pytest.raises(ValueError, match="got 3 condition images but at most 2 are accepted"):
        encode_conditioning(encoder, vae, "a cat", images[:3], output_resolution=32, max_images=2)
    with pytest.raises(ValueError, match="max_images must be an int from 1 to 16, got 17"):
        encode_conditioning(encoder, vae, "a cat", images[:1], output_resolution=32, max_images=17)
    cond = encode_conditioning(encoder, vae, "a cat", images[:16], output_resolution=32)
    assert cond.num_images == 16 and int(cond.positive.image_pad_mask.sum()) == 16


def test_processor_pixel_limits_that_break_the_pad_count_fail_clearly(parts, vae):
    model, _, _ = parts
    strict = Qwen21TextEncoder(model, build_tiny_processor(min_pixels=256 * 256))  # the real processor's minimum
    with pytest.raises(ValueError, match=r"makes \d+ <\|image_pad\|> tokens, but the model needs 4 .*from 256 to 4096"):
        encode_conditioning(strict, vae, "a cat", [Image.new("RGB", (64, 64))], output_resolution=64)


def test_prefix_memory_precheck_fails_before_encoding(encoder, vae, monkeypatch):
    calls = []
    monkeypatch.setattr(encoder, "encode_prompts", lambda *args: calls.append(args))
    image = Image.new("RGB", (64, 64))
    budget = PrefixMemoryBudget.for_transformer(TransformerConfig(), torch.bfloat16, free_bytes=2**30)
    assert budget.prefix_bytes(1) == 32 * 2 * 4096 * 2  # layers x (K, V) x inner_dim x bf16 bytes
    with pytest.raises(PrefixMemoryError, match=r"needs .* GiB \(positive \d+ tokens; .* only 1.00 GiB"):
        encode_conditioning(
            encoder, vae, "a cat", [image] * 2, negative_prompt="blurry", output_resolution=1024, memory_budget=budget
        )
    assert calls == []  # nothing ran


def test_a_prefix_too_big_for_the_gpu_passes_when_ram_can_hold_it(encoder, vae):
    """The sampler moves a prefix cache that does not fit the GPU to pinned RAM, so the precheck counts both: a
    two-image prefix (4.01 GiB) passes with 1 GiB free on the GPU and 4 GiB in RAM, and fails with 1 GiB in RAM."""
    image = Image.new("RGB", (64, 64))
    config = TransformerConfig()
    roomy = PrefixMemoryBudget.for_transformer(config, torch.bfloat16, free_bytes=2**30, host_bytes=4 * 2**30)
    cond = encode_conditioning(encoder, vae, "a cat", [image] * 2, output_resolution=1024, memory_budget=roomy)
    assert roomy.prefix_bytes(cond.extra["prefix_tokens"]["positive"]) > roomy.free_bytes
    tight = PrefixMemoryBudget.for_transformer(config, torch.bfloat16, free_bytes=2**30, host_bytes=2**30)
    with pytest.raises(PrefixMemoryError, match=r"1.00 GiB is free on the GPU and 1.00 GiB in RAM.*kv_cache fp8"):
        encode_conditioning(encoder, vae, "a cat", [image] * 2, output_resolution=1024, memory_budget=tight)


def test_the_pipelines_precheck_counts_the_gpu_the_leaving_encoder_and_ram(monkeypatch):
    from qwen21_nodes.qwen21_core import pipeline
    from qwen21_nodes.qwen21_core.memory import planner

    monkeypatch.setattr(planner, "device_free_bytes", lambda device, budget=None: 10 * 2**30)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # "cuda" is "cuda:0" here
    encoder = types.SimpleNamespace(device=torch.device("cuda", 0), device_weight_bytes=lambda: 3 * 2**30)
    transformer = types.SimpleNamespace(config=TransformerConfig())
    fake = types.SimpleNamespace(execution_device=torch.device("cuda"), vram_budget=None, text_encoder=encoder,
                                 text_encoder_offload=True, transformer=transformer, dtype=torch.bfloat16)  # fmt: skip
    monkeypatch.setattr(planner, "host_free_bytes", lambda: 20 * 2**30)
    budget = pipeline.Qwen21Pipeline._prefix_budget(fake)
    assert budget.free_bytes == 13 * 2**30 - planner.DECODE_HEADROOM_BYTES and budget.host_bytes == 20 * 2**30
    fake.text_encoder_offload = False  # the encoder stays: its weights are not free
    assert pipeline.Qwen21Pipeline._prefix_budget(fake).free_bytes == 10 * 2**30 - planner.DECODE_HEADROOM_BYTES
    monkeypatch.setattr(planner, "host_free_bytes", lambda: None)  # RAM unknown: no precheck rather than a false one
    assert pipeline.Qwen21Pipeline._prefix_budget(fake) is None


def test_host_free_ram_reads_psutil_or_proc_meminfo(monkeypatch):
    import sys

    from qwen21_nodes.qwen21_core.memory import planner

    if not __import__("os").path.exists("/proc/meminfo"):
        pytest.skip("needs Linux's /proc/meminfo to compare against")
    with_psutil = planner.host_free_bytes()
    monkeypatch.setitem(sys.modules, "psutil", None)  # as if not installed
    from_meminfo = planner.host_free_bytes()
    assert from_meminfo is not None and abs(from_meminfo - (with_psutil or from_meminfo)) < 2**30  # both read one value
    assert from_meminfo == max(0, planner._meminfo_available_bytes() - planner.HOST_RESERVE_BYTES)


def test_negative_prompt_counts_against_prefix_memory_only_when_encoded(encoder, vae, monkeypatch):
    """At cfg 1 the negative branch never exists, so encode checks the positive prefix alone; the lazy encode
    for true CFG checks both, before running the VLM."""
    image = Image.new("RGB", (64, 64))
    probe = encode_conditioning(encoder, vae, "a cat", [image], negative_prompt="blurry", output_resolution=64)
    tokens = probe.extra["prefix_tokens"]
    per_token = PrefixMemoryBudget(num_layers=2, inner_dim=64, dtype_bytes=2, free_bytes=0).prefix_bytes(1)
    # room for the positive prefix and half of the negative one
    budget = PrefixMemoryBudget(2, 64, 2, free_bytes=per_token * (tokens["positive"] + tokens["negative"] // 2))
    cond = encode_conditioning(
        encoder, vae, "a cat", [image], negative_prompt="blurry", output_resolution=64, memory_budget=budget
    )
    assert cond.negative is None
    calls = []
    monkeypatch.setattr(encoder, "encode_prompts", lambda *args: calls.append(args))
    with pytest.raises(PrefixMemoryError, match=r"positive \d+ tokens, negative \d+ tokens.*true_cfg_scale 1"):
        encode_negative(encoder, cond, memory_budget=budget)
    assert calls == [] and cond.negative is None and cond.negative_pending is not None


def test_negative_prompt_is_encoded_once_and_only_on_request(encoder, vae, monkeypatch):
    calls = []
    original = encoder.encode_prompts
    monkeypatch.setattr(
        encoder, "encode_prompts", lambda prompts, images: calls.append(list(prompts)) or original(prompts, images)
    )
    images = [_random_image(64, 64, "RGBA", 4)]
    cond = encode_conditioning(encoder, vae, "a cat", images, negative_prompt="blurry", output_resolution=64)
    assert calls == [["a cat"]]  # the positive prompt only
    pending, content_hash = cond.negative_pending, cond.content_hash
    encode_negative(encoder, cond)
    assert calls == [["a cat"], ["blurry"]]
    assert cond.negative_pending is None and cond.negative.length == pending.length
    assert int(cond.negative.image_pad_mask.sum()) == int(cond.positive.image_pad_mask.sum())  # same images
    assert cond.content_hash == content_hash  # cache keys do not depend on when the negative was encoded
    encode_negative(encoder, cond)
    assert len(calls) == 2  # encoded once
    plain = encode_conditioning(encoder, vae, "a cat", images, output_resolution=64)
    encode_negative(encoder, plain)  # no negative prompt: nothing to do
    assert plain.negative is None and not plain.has_negative and len(calls) == 3


def _prompt_of(encoder, text_tokens: int, pad_counts=()) -> str:
    """A prompt whose embedding has `text_tokens` tokens besides its <|image_pad|> slots (the template's included):
    the rotary positions its text takes in the DiT."""
    template = encoder.count_tokens("a " * 10, pad_counts) - sum(pad_counts) - 10  # "a ": one tiny-tokenizer token
    prompt = "a " * (text_tokens - template)
    assert encoder.count_tokens(prompt, pad_counts) - sum(pad_counts) == text_tokens
    return prompt


def test_a_prompt_too_long_for_the_dit_fails_before_the_encoder_runs_with_the_samplers_message(
    encoder, vae, monkeypatch
):
    calls = []
    monkeypatch.setattr(encoder, "encode_prompts", lambda *args: calls.append(args))
    too_long = ("a photo of a cat. " * 3000)[:50000]  # what a user pasted: 50,000 characters
    length = encoder.count_tokens(too_long, [])
    with pytest.raises(ValueError, match="outside the model's table") as sampler:  # where it failed before
        build_layout(torch.zeros(length, dtype=torch.bool), [], (64, 64))
    with pytest.raises(ValueError, match=rf"rotary position {length} is outside the model's table") as encoding:
        encode_conditioning(encoder, vae, too_long, output_resolution=1024)
    assert str(encoding.value) == str(sampler.value) and calls == []
    with pytest.raises(ValueError, match=rf"rotary position {length} is outside"):
        check_prompt_length(encoder, too_long)
    # the limit is the table's last position, where the target's frame axis sits: text tokens 0..N-1, target at N
    check_prompt_length(encoder, _prompt_of(encoder, ROPE_MAX_POSITION))
    with pytest.raises(ValueError, match=rf"rotary position {ROPE_MAX_POSITION + 1} is outside"):
        check_prompt_length(encoder, _prompt_of(encoder, ROPE_MAX_POSITION + 1))


def test_condition_images_count_against_the_rotary_table_as_the_sampler_lays_them_out(encoder, vae, monkeypatch):
    """A 1024x768 reference at output_resolution 1024 is resized to 1184x896: its 74x56 latent grid moves the
    position on by 74; the fast check from the source size and the encode agree on the edge."""
    calls = []
    monkeypatch.setattr(encoder, "encode_prompts", lambda *args: calls.append(args))
    image = Image.new("RGB", (1024, 768))
    pads = [(1184 // 32) * (896 // 32)]
    fits, over = (_prompt_of(encoder, ROPE_MAX_POSITION - 74 + extra, pads) for extra in (0, 1))
    check_prompt_length(encoder, fits, [(1024, 768)], 1024)
    with pytest.raises(ValueError, match=rf"rotary position {ROPE_MAX_POSITION + 1} is outside"):
        check_prompt_length(encoder, over, [(1024, 768)], 1024)
    with pytest.raises(ValueError, match=rf"rotary position {ROPE_MAX_POSITION + 1} is outside"):
        encode_conditioning(encoder, vae, over, [image], output_resolution=1024)
    assert calls == []


def test_a_too_long_negative_prompt_fails_when_guidance_would_encode_it(encoder, vae, monkeypatch):
    too_long = _prompt_of(encoder, ROPE_MAX_POSITION + 1)
    cond = encode_conditioning(encoder, vae, "a cat", negative_prompt=too_long, output_resolution=64)  # cfg 1: fine
    calls = []
    monkeypatch.setattr(encoder, "encode_prompts", lambda *args: calls.append(args))
    with pytest.raises(ValueError, match=rf"rotary position {ROPE_MAX_POSITION + 1} is outside"):
        encode_negative(encoder, cond)
    assert calls == []


def test_prefix_memory_precheck_passes_when_it_fits(encoder, vae):
    budget = PrefixMemoryBudget(num_layers=2, inner_dim=64, dtype_bytes=4, free_bytes=10**9)
    cond = encode_conditioning(encoder, vae, "a cat", negative_prompt="", output_resolution=64, memory_budget=budget)
    assert set(cond.extra["prefix_tokens"]) == {"positive", "negative"}
    assert cond.negative_pending.length == cond.extra["prefix_tokens"]["negative"]
    encode_negative(encoder, cond, memory_budget=budget)
    assert cond.negative.length == cond.extra["prefix_tokens"]["negative"]  # "" is encoded as " "


def test_wrong_argument_types_get_clear_errors(encoder, vae, monkeypatch):
    with pytest.raises(TypeError, match="prompt must be a str, got NoneType"):
        encode_conditioning(encoder, vae, None)
    with pytest.raises(TypeError, match="negative_prompt must be a str or None, got list"):
        encode_conditioning(encoder, vae, "a cat", negative_prompt=["x"])
    for resolution in (16, 100, 8192, 10**9, 1024.0, True):
        with pytest.raises(ValueError, match=rf"output_resolution must be an int multiple of 32 from 32 to 4096.*"
                                             rf"got {resolution}"):  # fmt: skip
            encode_conditioning(encoder, vae, "a cat", output_resolution=resolution)
    tokenized = []
    monkeypatch.setattr(encoder.processor, "tokenizer", lambda *args, **kwargs: tokenized.append(args))
    with pytest.raises(ValueError, match="prompt has 1000000 characters; at most 100000"):
        encode_conditioning(encoder, vae, "a" * 10**6)
    with pytest.raises(ValueError, match="prompt has 1000000 characters; at most 100000"):
        check_prompt_length(encoder, "a" * 10**6)
    assert tokenized == []  # refused before the tokenizer saw it
    with pytest.raises(TypeError, match=r"images\[1\] must be a ComfyUI IMAGE tensor, a PIL image or a numpy array"):
        encode_conditioning(encoder, vae, "a cat", [Image.new("RGB", (32, 32)), "photo.png"])


class _CountingVAE:
    """Our VAE, counting how many images it encodes."""

    def __init__(self, vae):
        self.inner, self.encoded = vae, 0

    def encode(self, images):
        self.encoded += images.shape[0]
        return self.inner.encode(images)

    def normalize(self, raw):
        return self.inner.normalize(raw)


def test_a_reference_used_again_is_neither_resized_nor_vae_encoded_again_and_encodes_the_same(encoder, vae):
    """A changed prompt with the same reference: the cache gives the same resized copies and latents (bit for bit
    what an uncached encode computes), and the same content hash as without a cache."""
    from qwen21_nodes.qwen21_core.reference_cache import ReferenceCache

    counting, cache = _CountingVAE(vae), ReferenceCache()
    counting.identity = "counting-vae"  # the VAE's identity in the cache and the content hash
    images = [_random_image(80, 45, "RGBA", 1), _random_image(64, 64, "RGB", 2)]
    first = encode_conditioning(encoder, counting, "a cat", images, output_resolution=64, references=cache)
    again = encode_conditioning(encoder, counting, "a dog", images, output_resolution=64, references=cache)
    assert counting.encoded == 2 and (cache.hits, cache.misses) == (2, 2)
    uncached = encode_conditioning(encoder, counting, "a dog", images, output_resolution=64)
    assert counting.encoded == 4  # no cache given: every image encoded
    for ours, fresh, earlier in zip(
        again.condition_latents, uncached.condition_latents, first.condition_latents, strict=True
    ):
        assert torch.equal(ours, fresh) and ours is earlier
    assert torch.equal(again.positive.embeds, uncached.positive.embeds)
    assert again.content_hash == uncached.content_hash != first.content_hash

    changed = images[0].copy()
    changed.putpixel((3, 3), (9, 9, 9, 9))
    encode_conditioning(encoder, counting, "a dog", [changed, images[1]], output_resolution=64, references=cache)
    assert counting.encoded == 5  # only the changed image
    encode_conditioning(encoder, counting, "a dog", images, output_resolution=96, references=cache)
    assert counting.encoded == 7  # another resolution is another resize


def test_a_reference_whose_alpha_alone_changed_is_a_new_reference(encoder, vae):
    """Someone editing repaints a reference's mask (ComfyUI's mask editor, LoadImage's MASK) and keeps its colours:
    the VAE reads the alpha and the VLM sees the image composited over white, so that reference must miss the
    cache, be encoded afresh and change the content hash (the prefix K/V cache's key). One pixel's alpha already
    changes the digest."""
    from qwen21_nodes.qwen21_core.images import source_digest
    from qwen21_nodes.qwen21_core.reference_cache import ReferenceCache

    image = _random_image(64, 64, "RGBA", 8)
    one_alpha = np.asarray(image).copy()
    one_alpha[40, 40, 3] ^= 0x80
    assert source_digest(Image.fromarray(one_alpha, "RGBA")) != source_digest(image), "the digest ignores alpha"

    counting, cache = _CountingVAE(vae), ReferenceCache()
    counting.identity = "counting-vae"
    pixels = torch.rand(1, 64, 64, 3, generator=torch.Generator().manual_seed(9))
    opaque, cut_out = torch.zeros(1, 64, 64), torch.zeros(1, 64, 64)
    cut_out[:, 16:48, 8:40] = 1.0  # transparent there; the colours are the same
    first = encode_conditioning(encoder, counting, "a cat", [pixels], [opaque], output_resolution=64, references=cache)
    again = encode_conditioning(encoder, counting, "a dog", [pixels], [opaque], output_resolution=64, references=cache)
    assert (cache.hits, cache.misses, counting.encoded) == (1, 1, 1)  # the same reference: from the cache
    edited = encode_conditioning(encoder, counting, "a dog", [pixels], [cut_out], output_resolution=64,
                                 references=cache)  # fmt: skip
    assert (cache.hits, cache.misses, counting.encoded) == (1, 2, 2), "the alpha-only change was served from the cache"
    assert edited.content_hash not in (first.content_hash, again.content_hash)
    uncached = encode_conditioning(encoder, counting, "a dog", [pixels], [cut_out], output_resolution=64)
    assert torch.equal(edited.condition_latents[0], uncached.condition_latents[0])
    assert not torch.equal(edited.condition_latents[0], again.condition_latents[0])
    assert not torch.equal(edited.positive.embeds, again.positive.embeds)  # the VLM sees white where it is cut out


def test_the_reference_cache_keeps_latents_per_vae_and_forgets_the_least_recently_used(encoder, vae):
    from qwen21_nodes.qwen21_core.reference_cache import ReferenceCache

    cache = ReferenceCache(max_images=1)
    one, two = _random_image(64, 64, "RGB", 5), _random_image(64, 64, "RGB", 6)
    first_vae, second_vae = _CountingVAE(vae), _CountingVAE(vae)
    first_vae.identity, second_vae.identity = "vae-a", "vae-b"
    encode_conditioning(encoder, first_vae, "a cat", [one], output_resolution=64, references=cache)
    encode_conditioning(encoder, second_vae, "a cat", [one], output_resolution=64, references=cache)
    assert (first_vae.encoded, second_vae.encoded) == (1, 1)  # another VAE encodes for itself
    encode_conditioning(encoder, first_vae, "a cat", [two], output_resolution=64, references=cache)
    encode_conditioning(encoder, first_vae, "a cat", [one], output_resolution=64, references=cache)
    assert first_vae.encoded == 3  # `two` pushed `one` out of a one-image cache
    assert cache.misses == 3 and cache.hits == 1
    encode_conditioning(encoder, first_vae, "a dog", [one], output_resolution=64, references=cache)
    assert first_vae.encoded == 3  # kept
    first_vae.dtype = torch.float64  # the same identity in another dtype: latents of its own
    encode_conditioning(encoder, first_vae, "a dog", [one], output_resolution=64, references=cache)
    assert first_vae.encoded == 4
