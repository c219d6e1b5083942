"""Velocities for another sampler's loop (qwen21_core/velocity.py), the engine behind our ComfyUI MODEL: a loop
written the way ComfyUI's euler sampler runs (float32 latents, denoised = x - sigma * v, x += (x - denoised) / sigma *
dt) gives our own sampler's latents, with each conditioning's prefix computed once per run."""

import numpy as np
import pytest
import torch
from PIL import Image
from qwen21_nodes.qwen21_core.conditioning import Conditioning
from qwen21_nodes.qwen21_core.sampler import make_noise
from qwen21_nodes.qwen21_core.scheduler import partial_schedule
from qwen21_nodes.qwen21_core.velocity import Part


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline
    from qwen21_nodes.runner.cli import ensure_tiny_models

    folder = ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models") / "diffusers" / "qwen_image_2.1_tiny"
    return Qwen21Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def cond(pipe):
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 4), dtype=np.uint8), "RGBA")
    cond = pipe.encode("make it red", images=[image], negative_prompt="blurry", output_resolution=64)
    pipe.encode_negative(cond)
    return cond


def negative_of(cond: Conditioning) -> Conditioning:
    """The negative prompt as a conditioning of its own, as a ComfyUI CONDITIONING carries it."""
    return Conditioning(cond.negative, condition_latents=cond.condition_latents, width=cond.width,
                        height=cond.height, content_hash=cond.content_hash + ":negative")  # fmt: skip


def comfy_euler(pipe, cond, noise, steps, cfg=1.0, batched=True):
    """ComfyUI's euler over our velocities: sigmas from our schedule, the guidance on denoised values."""
    h, w = noise.shape[-2:]
    device = pipe.device  # ComfyUI keeps the latents on the model's device between steps
    sigmas, _ = partial_schedule(pipe.scheduler_config, h * w, steps, 1.0)
    sigmas = sigmas.to(device)
    run = pipe.velocity_run(cond, h * 16, w * 16, noise.shape[0], guided=cfg > 1)
    mean = torch.tensor(pipe.vae.config.latents_mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std, device=device).view(1, -1, 1, 1)
    x = noise.to(device, torch.float32) * sigmas[0]
    negative = negative_of(cond)
    rows = noise.shape[0]
    try:
        for i in range(steps):
            sigma = sigmas[i].expand(rows)
            if cfg == 1.0:
                v = run.velocity(x, sigma, [Part(cond, "positive", rows)])
                denoised = x - v * sigmas[i]
            else:
                if batched:  # ComfyUI puts the uncond first when it batches them
                    both = run.velocity(torch.cat([x, x]), torch.cat([sigma, sigma]),
                                        [Part(negative, "negative", rows), Part(cond, "positive", rows)])  # fmt: skip
                    v_neg, v_pos = both[:rows], both[rows:]
                else:
                    v_neg = run.velocity(x, sigma, [Part(negative, "negative", rows)])
                    v_pos = run.velocity(x, sigma, [Part(cond, "positive", rows)])
                d_neg, d_pos = x - v_neg * sigmas[i], x - v_pos * sigmas[i]
                denoised = d_neg + (d_pos - d_neg) * cfg
            x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
    finally:
        run.close()
    return x * std + mean


@pytest.mark.parametrize("cfg, batched", [(1.0, True), (4.0, True), (4.0, False)],
                         ids=["cfg1", "cfg4-batched", "cfg4-separate"])  # fmt: skip
def test_a_comfyui_style_euler_loop_gives_our_samplers_latents(pipe, cond, cfg, batched):
    noise = make_noise(5, (1, 64, 4, 4))
    expected = pipe.sample(cond, steps=4, true_cfg_scale=cfg, noise=noise)
    got = comfy_euler(pipe, cond, noise, 4, cfg, batched)
    assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
    stats = pipe.last_sample_stats
    assert stats["prefills"] == (2 if cfg > 1 else 1)  # once per conditioning, not per step
    assert stats["steps"] == (4 if batched or cfg == 1 else 8)  # calls of the loop


def test_batch_rows_share_one_prefix_and_equal_single_runs(pipe, cond):
    noise = make_noise(7, (2, 64, 4, 4))
    both = comfy_euler(pipe, cond, noise, 3)
    assert pipe.last_sample_stats["prefills"] == 1
    for row in range(2):
        alone = comfy_euler(pipe, cond, noise[row : row + 1], 3)
        assert (both[row : row + 1] - alone).abs().max().item() <= 1e-5


def test_a_closed_run_refuses_more_calls_and_parts_must_cover_the_batch(pipe, cond):
    run = pipe.velocity_run(cond, 64, 64, 1)
    x = torch.zeros(2, 64, 4, 4)
    with pytest.raises(ValueError, match="cover 1 rows but the batch has 2"):
        run.velocity(x, torch.tensor([1.0]), [Part(cond, "positive", 1)])
    with pytest.raises(ValueError, match=r"latents must be \[B, 64, h, w\]"):
        run.velocity(torch.zeros(1, 16, 4, 4), torch.tensor([1.0]), [Part(cond, "positive", 1)])
    with pytest.raises(ValueError, match="role must be one of"):
        Part(cond, "uncond", 1)
    run.close()
    with pytest.raises(RuntimeError, match="closed"):
        run.velocity(x[:1], torch.tensor([1.0]), [Part(cond, "positive", 1)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none (run on the H200)")
def test_on_cuda_the_loop_replays_decode_graphs_and_keeps_the_prefix_between_runs(tmp_path_factory):
    """bf16 on CUDA: a ComfyUI-style loop through a VelocityRun agrees with our sampler within bf16's rounding (its
    latents stay fp32 between steps, ours bf16), replays decode steps from CUDA graphs from the second run of a
    shape on, and a second run of the same conditioning computes no prefix (the kept graph entry holds it)."""
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline
    from qwen21_nodes.runner.cli import ensure_tiny_models

    folder = ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models") / "diffusers" / "qwen_image_2.1_tiny"
    pipe = Qwen21Pipeline.from_pretrained(folder, device="cuda", dtype=torch.bfloat16)
    image = Image.fromarray(np.random.default_rng(3).integers(0, 256, (64, 64, 4), dtype=np.uint8), "RGBA")
    cond = pipe.encode("make it red", images=[image], output_resolution=256)
    noise = make_noise(5, (1, 64, 16, 16))
    expected = pipe.sample(cond, steps=8, noise=noise).float().cpu()
    runs = []
    for _ in range(3):
        got = comfy_euler(pipe, cond, noise, 8).float().cpu()
        runs.append(dict(pipe.last_sample_stats))
    assert (got - expected).abs().max().item() <= 0.05 * expected.abs().max().item()
    assert runs[-1]["replayed_steps"] > 0, runs[-1]
    assert runs[-1]["prefills"] == 0 and runs[-1]["prefix_cache"] == "reused", runs[-1]
