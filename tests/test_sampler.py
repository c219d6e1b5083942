"""The sampling loop against diffusers' QwenImage21Pipeline on the same tiny parts (CPU)."""

import numpy as np
import pytest
import torch
from benchmark_lines import json_records
from dit_reference import (
    CONTEXT,
    QWEN21_SCHEDULER_KW,
    our_dit,
    reference_dit,
    reference_pipeline,
    tiny_reference_vae,
)
from PIL import Image
from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
from qwen21_nodes.qwen21_core.config import SchedulerConfig
from qwen21_nodes.qwen21_core.request import SampleRequest
from qwen21_nodes.qwen21_core.sampler import Sampler, make_noise, pack, unpack

pytest.importorskip("diffusers")

Z = 16


@pytest.fixture(scope="module")
def parts():
    ref_dit = reference_dit()
    vae = tiny_reference_vae()
    return ref_dit, our_dit(ref_dit), vae


def _sampler(ours, vae, **kw):
    mean = torch.tensor(vae.config.latents_mean)
    std = torch.tensor(vae.config.latents_std)
    return Sampler(ours, SchedulerConfig(**QWEN21_SCHEDULER_KW), mean, std, **kw)


def _prompt(length, seed, slots=None):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(length, dtype=torch.bool) if slots is None else slots
    return PromptEmbedding(torch.randn(mask.shape[0], CONTEXT, generator=g), mask)


def _to_raw(packed, vae, h, w):
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1)
    return unpack(packed.float(), h, w) * std + mean


def _reference_sample(pipe, pos, neg, noise, height, width, steps, cfg=1.0, **kw):
    out = pipe(
        prompt_embeds=pos.embeds[None],
        negative_prompt_embeds=None if neg is None else neg.embeds[None],
        true_cfg_scale=cfg,
        height=height,
        width=width,
        num_inference_steps=steps,
        latents=pack(noise),
        output_type="latent",
        **kw,
    ).images
    return _to_raw(out, pipe.vae, height // 16, width // 16)


@pytest.mark.parametrize("cfg", [1.0, 4.0], ids=["t2i", "true-cfg-4"])
def test_text_to_image_matches_reference(parts, cfg):
    ref_dit, ours, vae = parts
    pos, neg = _prompt(9, 1), _prompt(6, 2)
    noise = make_noise(7, (1, Z, 4, 6))
    expected = _reference_sample(reference_pipeline(ref_dit, vae), pos, neg if cfg > 1 else None, noise, 64, 96, 4, cfg)
    sampler = _sampler(ours, vae)
    got = sampler.sample([Conditioning(pos, neg)], height=64, width=96, steps=4, true_cfg_scale=cfg, noise=noise)
    assert got.shape == (1, Z, 4, 6) and got.dtype == torch.float32
    assert (got - expected).abs().max().item() <= 1e-4
    assert sampler.stats.prefills == (2 if cfg > 1 else 1)
    assert 0 < sampler.stats.branch_setup_s < sampler.stats.seconds  # the caches' allocation, timed apart


def test_true_cfg_steps_with_the_negative_velocity_plus_cfg_times_the_difference(parts, monkeypatch):
    """One step at cfg 4 from the velocities the two branches really gave: x + (sigma1 - sigma0) * (v_neg + 4 * (v_pos
    - v_neg)); the negative branch gives another velocity than the positive one, so the result is not cfg 1's."""
    from qwen21_nodes.qwen21_core.scheduler import partial_schedule

    _, ours, vae = parts
    cond = Conditioning(_prompt(9, 1), _prompt(6, 2))
    noise = make_noise(7, (1, Z, 4, 4))
    results, velocities = {}, {}
    for cfg in (1.0, 4.0):
        sampler = _sampler(ours, vae)
        real = sampler._velocity
        seen = velocities[cfg] = []
        monkeypatch.setattr(sampler, "_velocity", lambda branch, x, t, real=real, seen=seen: seen.append(
            (x.clone(), real(branch, x, t))) or seen[-1][1])  # fmt: skip
        results[cfg] = sampler.sample([cond], height=64, width=64, steps=1, true_cfg_scale=cfg, noise=noise)
    assert len(velocities[1.0]) == 1 and len(velocities[4.0]) == 2  # the positive branch, then the negative
    (x, v_pos), (_, v_neg) = velocities[4.0]
    assert torch.equal(v_pos, velocities[1.0][0][1]) and (v_pos - v_neg).abs().max() > 0.01
    sigmas = partial_schedule(sampler.scheduler_config, 16, 1, 1.0)[0]
    expected = sampler.denormalize(unpack(x + (sigmas[1] - sigmas[0]) * (v_neg + 4.0 * (v_pos - v_neg)), 4, 4))
    error = (results[4.0] - expected).abs().max().item()
    assert error <= 1e-5, f"the guided step is {error:.3g} off v_neg + cfg * (v_pos - v_neg)"
    assert (results[4.0] - results[1.0]).abs().max() > 0.01


def test_two_condition_images_match_reference(parts):
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions

    ref_dit, ours, vae = parts
    pipe = reference_pipeline(ref_dit, vae)
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (64, 96, 4), dtype=np.uint8), "RGBA"),
        Image.fromarray(rng.integers(0, 256, (96, 64, 3), dtype=np.uint8), "RGB"),
    ]
    # the reference's own resize and VAE encode give the condition latents
    latents, sizes = [], []
    for img in images:
        width, height, _ = calculate_dimensions(64 * 64, img.size[0] / img.size[1])
        sizes.append((height // 16, width // 16))
        pixels = pipe.image_processor.preprocess(img.convert("RGBA"), width=width, height=height).unsqueeze(2)
        latents.append(pipe._encode_vae_image(pixels, None)[0, :, 0])
    slots = torch.zeros(7 + sum(h * w // 4 for h, w in sizes) + 4, dtype=torch.bool)
    slots[3 : 3 + sizes[0][0] * sizes[0][1] // 4] = True
    start = 3 + sizes[0][0] * sizes[0][1] // 4 + 2
    slots[start : start + sizes[1][0] * sizes[1][1] // 4] = True
    pos = _prompt(0, 3, slots)
    pipe.encode_prompt = lambda **kw: (pos.embeds[None], None, pos.image_pad_mask[None])
    noise = make_noise(1, (1, Z, 4, 4))
    expected = _reference_sample(pipe, pos, None, noise, 64, 64, 3, image=images, output_resolution=64)
    cond = Conditioning(pos, None, condition_latents=latents, width=64, height=64)
    got = _sampler(ours, vae).sample([cond], height=64, width=64, steps=3, noise=noise)
    assert (got - expected).abs().max().item() <= 1e-4


def test_turbo_sample_sigmas_match_reference(parts):
    ref_dit, ours, vae = parts
    turbo = [1.0, 0.8, 0.55, 0.3]
    pos = _prompt(8, 4)
    noise = make_noise(3, (1, Z, 4, 4))
    expected = _reference_sample(reference_pipeline(ref_dit, vae, sample_sigmas=turbo), pos, None, noise, 64, 64, 40)
    got = _sampler(ours, vae).sample([Conditioning(pos)], height=64, width=64, steps=4, sigmas=turbo, noise=noise)
    assert (got - expected).abs().max().item() <= 1e-4


def test_bf16_agrees_with_fp32(parts):
    """bf16 over 4 steps stays within 0.15 of fp32 on raw latents of std ~3 (stated tolerance)."""
    ref_dit, ours, vae = parts
    half = our_dit(ref_dit).to(torch.bfloat16)
    pos = _prompt(9, 5)
    noise = make_noise(11, (1, Z, 4, 4))
    full = _sampler(ours, vae).sample([Conditioning(pos)], height=64, width=64, steps=4, noise=noise)
    low = _sampler(half, vae).sample([Conditioning(pos.to(dtype=torch.bfloat16))], height=64, width=64, steps=4,
                                     noise=noise)  # fmt: skip
    err = (low - full).abs().max().item()
    assert 0 < err <= 0.15, err


def test_batch_of_two_equals_two_single_runs_and_prefills_once(parts):
    _, ours, vae = parts
    pos = _prompt(9, 6)
    noise = make_noise(5, (2, Z, 4, 4))
    sampler = _sampler(ours, vae)
    batched = sampler.sample([Conditioning(pos)], height=64, width=64, steps=3, batch_size=2, noise=noise)
    assert sampler.stats.prefills == 1
    for row in range(2):
        single = _sampler(ours, vae).sample([Conditioning(pos)], height=64, width=64, steps=3,
                                            noise=noise[row : row + 1])  # fmt: skip
        assert (batched[row] - single[0]).abs().max().item() <= 1e-5


def test_several_conditionings_come_back_request_major(parts):
    _, ours, vae = parts
    conds = [Conditioning(_prompt(9, 7)), Conditioning(_prompt(5, 8))]
    noise = make_noise(2, (4, Z, 4, 4))
    both = _sampler(ours, vae).sample(conds, height=64, width=64, steps=2, batch_size=2, noise=noise)
    second = _sampler(ours, vae).sample(conds[1:], height=64, width=64, steps=2, batch_size=2, noise=noise[2:])
    assert torch.allclose(both[2:], second, atol=1e-5)


def test_seed_follows_comfyui_convention(parts):
    _, ours, vae = parts
    expected = torch.randn((1, Z, 4, 4), generator=torch.manual_seed(42), dtype=torch.float32)
    assert torch.equal(make_noise(42, (1, Z, 4, 4)), expected)
    cond = [Conditioning(_prompt(9, 9))]
    a = _sampler(ours, vae).sample(cond, height=64, width=64, steps=2, seed=42)
    b = _sampler(ours, vae).sample(cond, height=64, width=64, steps=2, noise=expected)
    assert torch.equal(a, b)


def test_callback_sees_x0_and_can_interrupt_leaving_nothing_behind(parts, monkeypatch):
    _, ours, vae = parts
    branches = []
    original = ours.new_branch
    monkeypatch.setattr(ours, "new_branch", lambda *a, **k: branches.append(original(*a, **k)) or branches[-1])
    seen = []

    class Stop(Exception):
        pass

    def callback(step, total, x0):
        seen.append((step, total, tuple(x0.shape)))
        if step == 2:
            raise Stop

    with pytest.raises(Stop):
        _sampler(ours, vae).sample([Conditioning(_prompt(9, 10))], height=64, width=64, steps=5, callback=callback)
    assert seen == [(1, 5, (1, Z, 4, 4)), (2, 5, (1, Z, 4, 4))]
    assert branches and not any(b.cache.allocated for b in branches)


def test_start_latents_with_denoise(parts):
    _, ours, vae = parts
    sampler = _sampler(ours, vae)
    start = torch.randn(1, Z, 4, 4)
    out = sampler.sample([Conditioning(_prompt(9, 12))], height=64, width=64, steps=3, start_latents=start,
                         denoise=0.5)  # fmt: skip
    assert sampler.stats.steps == 3 and out.shape == start.shape
    with pytest.raises(ValueError, match="set width/height to 0 to follow the LATENT"):
        sampler.sample([Conditioning(_prompt(9, 12))], height=64, width=96, steps=3, start_latents=start)


def test_img2img_starts_from_sigma0_noise_plus_the_rest_of_the_normalised_start(parts, monkeypatch):
    """With a zero velocity every Euler step keeps x, so the result (and every preview's x0) is the starting state:
    sigma0 * noise + (1 - sigma0) * normalize(start), denormalised. Denoise 0.25 puts sigma0 near 0.27, far from
    0.5, so a start with the two weights swapped (73% noise) cannot pass for it; at denoise 0.5 (sigma0 0.506) it
    could."""
    from qwen21_nodes.qwen21_core.scheduler import partial_schedule

    _, ours, vae = parts
    sampler = _sampler(ours, vae)
    monkeypatch.setattr(sampler, "_velocity", lambda branch, x, t: torch.zeros_like(x))
    start = 3 * torch.randn(1, Z, 4, 4, generator=torch.Generator().manual_seed(21)) + 1
    noise = make_noise(22, (1, Z, 4, 4))
    previews = []
    out = sampler.sample([Conditioning(_prompt(9, 12))], height=64, width=64, steps=3, start_latents=start,
                         denoise=0.25, noise=noise, callback=lambda step, total, x0: previews.append(x0))  # fmt: skip
    sigma0 = partial_schedule(sampler.scheduler_config, 16, 3, 0.25)[0][0].item()
    assert abs(sigma0 - 0.5) > 0.2, sigma0  # else a swap would hardly show
    expected = sampler.denormalize(sigma0 * noise + (1 - sigma0) * sampler.normalize(start))
    assert len(previews) == 3
    for got in [out, *previews]:
        error = (got - expected).abs().max().item()
        assert error <= 1e-5, f"the img2img start is {error:.4g} off sigma0 * noise + (1 - sigma0) * start"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(height=100, width=64), "height 100 is not a positive multiple of 32.*use 96"),
        (dict(height=64, width=70), "width 70 is not a positive multiple of 32.*use 64"),
        (dict(height=64, width=64, noise=torch.zeros(1, Z, 2, 2)), r"noise must have the latent shape \[1, 16, 4, 4\]"),
        (dict(height=64, width=64, true_cfg_scale=0.5), "true_cfg_scale must be >= 1"),
        (dict(height=64, width=64, batch_size=0), "batch_size must be >= 1"),
        (dict(height=64, width=8192), "width 8192 is more than 4096"),
        (dict(height=10**6 * 32, width=64), "height 32000000 is more than 4096"),
        (dict(height=64, width=64, batch_size=10**6), "batch_size must be from 1 to 16"),
        (dict(height=64, width=64, sigmas=[0.5] * 201), "201 sigmas.*at most 200"),
        (dict(height=64, width=64, steps=10**9), "steps must be .* at most 200"),
        (dict(height=64, width=64, start_latents=torch.zeros(1, Z, 4, 4), denoise=1e-9), "denoise 1e-09"),
    ],
)
def test_bad_inputs_are_clear_errors(parts, kwargs, message, monkeypatch):
    """Sizes, batch and schedule length are checked in the core (a value may arrive through a link, not a widget),
    before the noise is allocated."""
    from qwen21_nodes.qwen21_core import sampler as sampler_module

    def no_noise(*args):
        raise AssertionError("the noise was allocated before the inputs were checked")

    monkeypatch.setattr(sampler_module, "make_noise", no_noise)
    _, ours, vae = parts
    with pytest.raises(ValueError, match=message):
        _sampler(ours, vae).sample([Conditioning(_prompt(4, 0))], **{"steps": 2, **kwargs})


def test_sampling_bytes_counts_what_the_caches_really_hold(parts):
    """The cache part of the memory estimate ComfyUI gets is exactly what the sampler allocates: measured from
    the allocations of a cfg-1 and a cfg-2 run (the activation term, the same for both since branches run one
    after another, is checked against the H200 measurements below)."""
    from qwen21_nodes.qwen21_core.conditioning import PendingPrompt
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline

    _, ours, vae = parts
    slots, negative_slots = torch.zeros(12, dtype=torch.bool), torch.zeros(9, dtype=torch.bool)
    slots[2:6] = True
    negative_slots[1:5] = True
    cond = Conditioning(_prompt(0, 1, slots), _prompt(0, 2, negative_slots), condition_latents=[torch.zeros(Z, 4, 4)])
    allocated = {}
    for cfg in (1.0, 2.0):
        sampler = _sampler(ours, vae)
        sampler.sample([cond], height=64, width=64, steps=1, true_cfg_scale=cfg, batch_size=2)
        allocated[cfg] = sampler.stats.cache_bytes
    pipe = Qwen21Pipeline.__new__(Qwen21Pipeline)
    pipe.transformer = ours
    estimate = {cfg: pipe.sampling_bytes(cond, _request(cfg)) for cfg in (1.0, 2.0)}
    assert allocated[2.0] > allocated[1.0] > 0
    assert estimate[2.0] - estimate[1.0] == allocated[2.0] - allocated[1.0]  # the negative branch's cache
    assert estimate[1.0] > allocated[1.0]  # plus activations
    # a negative prompt not encoded yet counts the same (its length is known from the tokenizer)
    pending = Conditioning(
        cond.positive, negative_pending=PendingPrompt("x", (), 9), condition_latents=[torch.zeros(Z, 4, 4)]
    )
    assert pipe.sampling_bytes(pending, _request(2.0)) == estimate[2.0]
    assert pipe.sampling_bytes(pending, _request(1.0)) == estimate[1.0]  # and not at all without guidance


def _request(cfg: float) -> SampleRequest:
    return SampleRequest(height=64, width=64, batch_size=2, true_cfg_scale=cfg)


MIB = 2**20


def _first_release(record) -> bool:
    return record["recorded"] == "7c45419"  # the first DiT run's lines


def _measured_with_a_layout_that_exists(record) -> bool:
    """The first release's batch > 1 lines (no `kv_layout` field) were measured with one prefix and persistent
    per-row target K/V, a cache layout that no longer exists, so nothing today can be checked against them. Their
    replacement is `bash benchmarks/h200.sh dit-batch`, whose line (with `kv_layout`) enters the check below."""
    return "kv_layout" in record or not (_first_release(record) and record["batch"] > 1)


def test_only_the_first_releases_batch_4_line_is_left_out_of_the_memory_check():
    left_out = [r["case"] for r in json_records("dit_case") if not _measured_with_a_layout_that_exists(r)]
    assert left_out in ([], ["1024_ref0_cfg1_b4"])


@pytest.mark.parametrize(
    "record",
    [r for r in json_records("dit_case") if _measured_with_a_layout_that_exists(r)],
    ids=lambda record: record["case"],
)
def test_sampling_bytes_agrees_with_the_h200_measurements(record):
    """The full-size estimate against bench_dit's lines in benchmarks/results: the K/V caches of the layout the line
    was measured with (`ours_cache_mib`) plus an activation term that covers the measured decode-step peak
    (`ours_decode_peak_extra_mib`), and equals it where the decode step dominates (prefix <= batch x target).
    Lines without `kv_layout` / `kv_cache` fields: those of the first release's DiT run have today's "joint"
    layout (batch 1 only; see _measured_with_a_layout_that_exists); those of the quantised DiT run were measured
    with the default of their commit, split bf16."""
    import types

    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.options import SampleOptions
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline

    res, batch, cfg = record["res"], record["batch"], record["cfg"]
    layout = record.get("kv_layout", "joint" if _first_release(record) else "split")
    options = SampleOptions(kv_layout=layout, kv_cache=record.get("kv_cache", "bf16"))
    side = res // 16
    slots = record["nref"] * side * side // 4
    length = record["prefix_tokens"] - 3 * slots  # every image slot stands for 4 prefix tokens
    mask = torch.zeros(length, dtype=torch.bool)
    mask[:slots] = True
    prompt = PromptEmbedding(torch.zeros(length, 1), mask)
    images = [torch.zeros(1, side, side)] * record["nref"]
    cond = Conditioning(prompt, prompt if cfg > 1 else None, condition_latents=images)
    pipe = Qwen21Pipeline.__new__(Qwen21Pipeline)
    pipe.transformer = types.SimpleNamespace(config=TransformerConfig(), dtype=torch.bfloat16)

    request = SampleRequest(height=res, width=res, batch_size=batch, true_cfg_scale=cfg)
    estimate = pipe.sampling_bytes(cond, request, options, kv_placement="gpu")
    activations = estimate - record["ours_cache_mib"] * MIB
    peak = record["ours_decode_peak_extra_mib"] * MIB
    assert activations >= peak - MIB
    if record["prefix_tokens"] <= batch * record["target_tokens"]:
        assert activations <= peak + MIB


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from qwen21_nodes.runner.cli import ensure_tiny_models

    return ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models") / "diffusers" / "qwen_image_2.1_tiny"


def test_lazy_negative_prompt_with_true_cfg_matches_the_reference_pipeline(tiny_folder, monkeypatch):
    """pipe.encode leaves the negative prompt pending; pipe.sample at cfg 4 encodes it once (with the condition
    image) and the whole generation matches diffusers' QwenImage21Pipeline, which encodes both prompts itself."""
    from diffusers import QwenImage21Pipeline
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline

    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 4), dtype=np.uint8), "RGBA")
    reference = QwenImage21Pipeline.from_pretrained(tiny_folder)
    pipe = Qwen21Pipeline.from_pretrained(tiny_folder, device="cpu", dtype=torch.float32)
    calls = []
    original = pipe.text_encoder.encode_prompts
    monkeypatch.setattr(
        pipe.text_encoder,
        "encode_prompts",
        lambda prompts, images: calls.append(list(prompts)) or original(prompts, images),
    )
    cond = pipe.encode("make it red", images=[image], negative_prompt="blurry", output_resolution=64)
    assert calls == [["make it red"]] and cond.negative is None
    noise = make_noise(5, (1, 64, 4, 4))
    got = pipe.sample(cond, steps=3, true_cfg_scale=4.0, noise=noise)
    assert calls == [["make it red"], ["blurry"]] and pipe.last_sample_stats["prefills"] == 2
    expected = reference(
        prompt="make it red", negative_prompt="blurry", image=[image], true_cfg_scale=4.0, output_resolution=64,
        num_inference_steps=3, latents=pack(noise), output_type="latent",
    ).images  # fmt: skip
    assert (got - _to_raw(expected, reference.vae, 4, 4)).abs().max().item() <= 1e-4
    again = pipe.sample(cond, steps=3, true_cfg_scale=4.0, noise=noise)
    assert len(calls) == 2 and torch.equal(again, got)  # encoded once


def test_sampler_refuses_a_pending_negative_prompt_under_cfg(parts):
    from qwen21_nodes.qwen21_core.conditioning import PendingPrompt

    _, ours, vae = parts
    cond = Conditioning(_prompt(9, 1), negative_pending=PendingPrompt("blurry", (), 6))
    with pytest.raises(ValueError, match="negative prompt is not encoded yet"):
        _sampler(ours, vae).sample([cond], height=64, width=64, steps=1, true_cfg_scale=4.0)
    assert _sampler(ours, vae).sample([cond], height=64, width=64, steps=1).shape == (1, Z, 4, 4)  # cfg 1: unused
