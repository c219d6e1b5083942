"""Fun-Control (control and inpainting) on the CPU: the branch against DiffSynth-Studio's Qwen-Image-2.1 ControlNet
(diffsynth 2.1.12, which recomputes the whole sequence every call) with our prefix caches for both streams; the
sampler's control range; the context (control latents, keep mask, inpaint latents); the decode graphs' keys and
adoption with control; loading both file layouts and refusing others.

Stated bound: fp32, relative max error <= 1e-4 against the reference (observed about 2e-7); strength 0 is the plain
model bit for bit."""

from __future__ import annotations

import pytest
import torch
from control_reference import (
    CHANNELS,
    CONTEXT,
    CONTROL_BLOCKS,
    CONTROL_DIT,
    our_models,
    reference_models,
    reference_velocity,
)
from dit_reference import QWEN21_SCHEDULER_KW, prompt_mask
from fake_cuda_graph import RecordingCapture
from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
from qwen21_nodes.qwen21_core.config import SchedulerConfig
from qwen21_nodes.qwen21_core.control import Control, active_steps, control_context
from qwen21_nodes.qwen21_core.dit.control import CONTROL_CHANNELS, injection_layers
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.sampler import Sampler, make_noise, pack
from qwen21_nodes.qwen21_core.scheduler import euler_step, partial_schedule, step_percents

TOLERANCE = 1e-4
DUMMY_IMAGE = torch.zeros(1, 16, 16, 3)  # a Control needs an image or a mask; the tests below give its context


@pytest.fixture(scope="module")
def models():
    pytest.importorskip("diffsynth", reason="diffsynth (the test extras) is the Fun-Control reference")
    ref_dit, ref_net = reference_models()
    dit, net = our_models(ref_dit, ref_net)
    return ref_dit, ref_net, dit, net


def _inputs(seed=1, condition_shapes=((4, 4),), target=(4, 6), batch=2):
    g = torch.Generator().manual_seed(seed)
    mask = prompt_mask(5, list(condition_shapes))
    embeds = torch.randn(mask.numel(), CONTEXT, generator=g)
    tokens = sum(h * w for h, w in condition_shapes)
    cond_tokens = torch.randn(tokens, CHANNELS, generator=g) if tokens else None
    x = torch.randn(batch, target[0] * target[1], CHANNELS, generator=g)
    context = torch.randn(target[0] * target[1], CONTROL_CHANNELS, generator=g)
    return mask, embeds, cond_tokens, x, context


def _relative(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _controlled_branch(dit, net, layout, batch, strength, context):
    branch = dit.new_branch(layout, batch, control=Control(net, strength, image=DUMMY_IMAGE))
    branch.control.set_context(context)
    return branch


@pytest.mark.parametrize("strength", [1.0, 0.6, -0.5])
@pytest.mark.parametrize("condition_shapes", [(), ((4, 4),)], ids=["text", "one-image"])
def test_a_controlled_step_matches_diffsynth_with_both_prefixes_cached(models, strength, condition_shapes):
    ref_dit, ref_net, dit, net = models
    mask, embeds, cond_tokens, x, context = _inputs(condition_shapes=condition_shapes)
    layout = build_layout(mask, list(condition_shapes), (4, 6))
    branch = _controlled_branch(dit, net, layout, 2, strength, context)
    dit.prefill(branch, embeds, cond_tokens)
    for t in (0.9, 0.4):  # the second step reads both prefixes from their caches, nothing recomputed
        tt = torch.full((2,), t)
        expected = reference_velocity(ref_dit, ref_net, embeds, mask, cond_tokens, list(condition_shapes), x * t, tt,
                                      (4, 6), context, strength)  # fmt: skip
        assert _relative(dit.decode(branch, x * t, tt), expected) <= TOLERANCE
    plain = reference_velocity(ref_dit, ref_net, embeds, mask, cond_tokens, list(condition_shapes), x, tt, (4, 6))
    assert _relative(plain, expected) > 0.05  # the branch changes the velocity: the check above can fail


def test_strength_zero_is_the_plain_model_bit_for_bit(models):
    _, _, dit, net = models
    mask, embeds, cond_tokens, x, context = _inputs()
    layout = build_layout(mask, [(4, 4)], (4, 6))
    plain = dit.new_branch(layout, 2)
    controlled = _controlled_branch(dit, net, layout, 2, 0.0, context)
    for branch in (plain, controlled):
        dit.prefill(branch, embeds, cond_tokens)
    t = torch.full((2,), 0.5)
    assert torch.equal(dit.decode(controlled, x, t), dit.decode(plain, x, t))
    assert not Control(net, 0.0, image=DUMMY_IMAGE).on  # and the sampler runs the plain branch for it


def test_the_control_blocks_follow_every_second_base_block():
    assert injection_layers(32, 16) == tuple(range(0, 32, 2))
    assert injection_layers(CONTROL_DIT["num_layers"], CONTROL_BLOCKS) == (0, 2)
    with pytest.raises(ValueError, match="cannot pair"):
        injection_layers(2, 3)


# ---------------------------------------------------------------------------------------------------------
# The sampler: the control range and its branches
# ---------------------------------------------------------------------------------------------------------


def _sampler(dit, context, **kw):
    mean, std = torch.linspace(-0.5, 0.5, CHANNELS), torch.linspace(0.8, 1.2, CHANNELS)
    return Sampler(dit, SchedulerConfig(**QWEN21_SCHEDULER_KW), mean, std, control_context=context, **kw), mean, std


def _reference_loop(ref_dit, ref_net, embeds, mask, noise, steps, context, strength, active, mean, std):
    """Euler over the reference's full forward, control on at the `active` steps."""
    config = SchedulerConfig(**QWEN21_SCHEDULER_KW)
    h, w = noise.shape[-2:]
    sigmas, timesteps = partial_schedule(config, h * w, steps, 1.0)
    x = pack(noise)
    for i in range(steps):
        t = timesteps[i].expand(x.shape[0]) / 1000
        v = reference_velocity(ref_dit, ref_net, embeds, mask, None, [], x, t, (h, w),
                               context if active[i] else None, strength)  # fmt: skip
        x = euler_step(x, v, sigmas[i], sigmas[i + 1])
    raw = x.transpose(1, 2).reshape(noise.shape) * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)
    return raw, sigmas


@pytest.mark.parametrize("start,end,expected", [(0.0, 1.0, [True] * 4), (0.5, 1.0, [False, False, True, True]),
                                                (0.0, 0.25, [True, True, False, False]),
                                                (0.25, 0.5, [False, True, True, False])])  # fmt: skip
def test_the_sampler_runs_control_at_the_steps_of_its_range(models, start, end, expected):
    ref_dit, ref_net, dit, net = models
    mask, embeds, _, _, context = _inputs(condition_shapes=(), target=(4, 4), batch=1)
    noise = make_noise(5, (1, CHANNELS, 4, 4))
    sampler, mean, std = _sampler(dit, context)
    cond = Conditioning(PromptEmbedding(embeds, mask))
    control = Control(net, 0.8, start, end, image=DUMMY_IMAGE)
    got = sampler.sample([cond], height=64, width=64, steps=4, noise=noise, control=control)
    assert active_steps(step_percents(4), start, end) == expected
    want, _ = _reference_loop(ref_dit, ref_net, embeds, mask, noise, 4, context, 0.8, expected, mean, std)
    assert _relative(got, want) <= TOLERANCE
    assert sampler.stats.prefills == len(set(expected))  # one prefix per kind of step: controlled, plain
    everywhere, _ = _reference_loop(ref_dit, ref_net, embeds, mask, noise, 4, context, 0.8, [True] * 4, mean, std)
    assert all(expected) or _relative(everywhere, want) > 1e-3  # the range matters: the check can fail


def test_with_true_cfg_both_prompts_run_controlled(models):
    ref_dit, ref_net, dit, net = models
    mask, embeds, _, _, context = _inputs(condition_shapes=(), target=(4, 4), batch=1)
    g = torch.Generator().manual_seed(9)
    negative = PromptEmbedding(torch.randn(4, CONTEXT, generator=g), torch.zeros(4, dtype=torch.bool))
    noise = make_noise(6, (1, CHANNELS, 4, 4))
    sampler, mean, std = _sampler(dit, context)
    got = sampler.sample([Conditioning(PromptEmbedding(embeds, mask), negative)], height=64, width=64, steps=2,
                         true_cfg_scale=3.0, noise=noise, control=Control(net, 1.0, image=DUMMY_IMAGE))  # fmt: skip
    config = SchedulerConfig(**QWEN21_SCHEDULER_KW)
    sigmas, timesteps = partial_schedule(config, 16, 2, 1.0)
    x = pack(noise)
    for i in range(2):
        t = timesteps[i].expand(1) / 1000
        pos = reference_velocity(ref_dit, ref_net, embeds, mask, None, [], x, t, (4, 4), context, 1.0)
        neg = reference_velocity(ref_dit, ref_net, negative.embeds, negative.image_pad_mask, None, [], x, t, (4, 4),
                                 context, 1.0)  # fmt: skip
        x = euler_step(x, neg + 3.0 * (pos - neg), sigmas[i], sigmas[i + 1])
    want = x.transpose(1, 2).reshape(noise.shape) * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)
    assert _relative(got, want) <= TOLERANCE and sampler.stats.prefills == 2


def test_decode_graphs_keep_controlled_and_plain_steps_apart_and_adopt_a_new_control_image(models):
    _, _, dit, net = models
    mask, embeds, _, _, context = _inputs(condition_shapes=(), target=(4, 4), batch=1)
    other = torch.randn(context.shape, generator=torch.Generator().manual_seed(11))
    cond = Conditioning(PromptEmbedding(embeds, mask))
    recorder = RecordingCapture()
    graphs = DecodeGraphs(dit, launch_bound_share=0, capture=recorder)
    kw = dict(height=64, width=64, steps=4, seed=3)
    for run, ctx in enumerate((context, other, context)):
        control = Control(net, 0.7, 0.5, 1.0, image=torch.full((1, 8, 8, 3), float(run)))  # identity differs per run
        eager = _sampler(dit, ctx)[0].sample([cond], control=control, **kw)
        graphed = _sampler(dit, ctx, decode_runner=graphs)[0].sample([cond], control=control, **kw)
        graphs.end_generation()
        assert torch.equal(graphed, eager), run  # the adopted entry's context buffer holds this run's context
    assert recorder.captures == 2  # a plain and a controlled entry, adopted by the later runs


# ---------------------------------------------------------------------------------------------------------
# The context
# ---------------------------------------------------------------------------------------------------------


class _Encoder:
    """A stand-in VAE encode: latents [1, 4, H/16, W/16] from 16x16 means of the RGB channels (and their sum), and the
    images it was given."""

    def __init__(self):
        self.seen = []

    def __call__(self, images):
        self.seen.append(images.clone())
        pooled = torch.nn.functional.avg_pool2d(images.permute(0, 3, 1, 2), 16)
        return torch.cat([pooled, pooled.sum(1, keepdim=True)], dim=1)


def test_the_context_holds_control_latents_keep_mask_and_inpaint_latents():
    mean, std = torch.tensor([0.1, 0.2, 0.3, 0.4]), torch.tensor([2.0, 2.0, 4.0, 4.0])
    encoder = _Encoder()
    image = torch.rand(2, 40, 48, 4)  # another size than the output, a batch, an alpha: first image, RGB, stretched
    inpaint = torch.rand(1, 64, 64, 3)
    mask = torch.zeros(1, 64, 64)
    mask[:, :32, :] = 1.0  # regenerate the top half
    control = Control(object(), image=image, inpaint_image=inpaint, mask=mask)
    context = control_context(control, encoder, mean, std, (4, 4))
    assert context.shape == (16, 2 * 4 + 1)
    assert [tuple(seen.shape) for seen in encoder.seen] == [(1, 64, 64, 3), (1, 64, 64, 3)]
    stretched = torch.nn.functional.interpolate(image[:1, ..., :3].permute(0, 3, 1, 2), size=(64, 64), mode="bicubic")
    assert torch.equal(encoder.seen[0], stretched.permute(0, 2, 3, 1))
    filled = encoder.seen[1]
    assert torch.equal(filled[0, :32], torch.full((32, 64, 3), 0.5))  # regenerated: mid-grey
    assert torch.equal(filled[0, 32:], inpaint[0, 32:])  # kept: the inpaint image
    grid = context.transpose(0, 1).reshape(9, 4, 4)
    assert torch.equal(grid[4], torch.tensor([[0.0] * 4] * 2 + [[1.0] * 4] * 2))  # keep = 1 - regenerate
    expected_hint = (encoder(stretched.permute(0, 2, 3, 1))[0] - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    assert torch.allclose(grid[:4], expected_hint)


def test_without_a_mask_everything_is_regenerated_and_the_inpaint_image_is_ignored():
    encoder = _Encoder()
    control = Control(object(), image=torch.rand(1, 64, 64, 3), inpaint_image=torch.rand(1, 64, 64, 3))
    context = control_context(control, encoder, torch.zeros(4), torch.ones(4), (4, 4))
    assert len(encoder.seen) == 1  # the control image only
    assert not context[:, 4:].any()  # keep 0, inpaint latents 0
    mask_only = Control(object(), mask=torch.ones(64, 64))
    context = control_context(mask_only, _Encoder(), torch.zeros(4), torch.ones(4), (4, 4))
    assert not context.any()  # no control image: zero latents; all regenerated: keep 0


@pytest.mark.parametrize("kwargs,words", [
    (dict(strength=11.0), "strength must be a number from -10.0 to 10.0"),
    (dict(start=-0.1), "start_percent must be from 0 to 1"),
    (dict(end=1.5), "end_percent must be from 0 to 1"),
    (dict(image=None), "needs a control_image, or a mask"),
    (dict(image=torch.zeros(16, 16, 3)), r"control image must be a ComfyUI IMAGE \[B, H, W, 3 or 4\]"),
    (dict(mask=torch.zeros(1, 1, 8, 8)), r"control mask must be a MASK"),
])  # fmt: skip
def test_bad_control_inputs_are_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Control(object(), **{"image": DUMMY_IMAGE, **kwargs})


# ---------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    from qwen21_nodes.qwen21_core.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("control_tiny"))


def _file_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_the_released_layout_and_comfyuis_fused_one_load_the_same_branch(tiny_files, tmp_path):
    from qwen21_nodes.qwen21_core.checkpoints.loading import load_fun_control
    from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER
    from safetensors.torch import save_file

    released = _file_tensors(tiny_files["control"])
    assert "control_blocks.0.img_mlp.gate_layer.weight" in released  # the alibaba-pai / ComfyUI-repack names
    net, info = load_fun_control(tiny_files["control"], TINY_TRANSFORMER, "cpu", torch.float32)
    assert info["layout"] == "diffusers" and info["blocks"] == "1" and net.quantization == "float32"
    for key, slot in net.checkpoint_slots().items():
        assert torch.equal(slot, released[key]), key
    fused = {}
    for key, tensor in released.items():
        if key.endswith("img_mlp.proj.weight"):
            continue
        if key.endswith("img_mlp.gate_layer.weight"):
            stem = key[: -len("gate_layer.weight")]
            fused[stem + "gate_up.weight"] = torch.cat([tensor, released[stem + "proj.weight"]])
        else:
            fused[key] = tensor
    save_file(fused, str(tmp_path / "fused.safetensors"))
    again, info = load_fun_control(tmp_path / "fused.safetensors", TINY_TRANSFORMER, "cpu", torch.float32)
    assert info["layout"] == "comfyui"
    for (key, a), b in zip(net.checkpoint_slots().items(), again.checkpoint_slots().values(), strict=True):
        assert torch.equal(a, b), key


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_the_control_blocks_load_quantised_and_still_steer_the_step(tiny_files, fmt):
    from qwen21_nodes.qwen21_core.checkpoints.loading import load_fun_control
    from qwen21_nodes.qwen21_core.dit.control import QuantizedSkip
    from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER

    net, _ = load_fun_control(tiny_files["control"], TINY_TRANSFORMER, "cpu", torch.float32, weight_format=fmt)
    assert net.quantization.startswith(fmt) and "(4/4 block linears)" in net.quantization
    assert isinstance(net.control_img_in, torch.nn.Linear) and isinstance(net.before_proj, torch.nn.Linear)
    # the skips are quantised with the blocks, their biases kept float and read from the file
    float_net, _ = load_fun_control(tiny_files["control"], TINY_TRANSFORMER, "cpu", torch.float32)
    assert all(isinstance(skip, torch.nn.Linear) for skip in float_net.after_proj)  # "auto" on a float file
    for skip, float_skip in zip(net.after_proj, float_net.after_proj, strict=True):
        assert isinstance(skip, QuantizedSkip) and skip.linear.fmt.kind == fmt
        assert torch.equal(skip.bias, float_skip.bias)
        weight = skip.linear.float_weight(torch.float32)
        error = ((weight - float_skip.weight).abs().max() / float_skip.weight.abs().max()).item()
        assert 0 < error < 0.07  # quantised from the file's weight, not left empty or random


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("backend", ["emulate", "weight_only"])
def test_a_quantised_skip_adds_strength_times_its_projection(use_settings, fmt, backend):
    """add_skip with a QuantizedSkip: h + strength * (W c + b) through the quantised GEMM and the fused epilogue, as
    the bf16 skip's torch add within the format's error; the strength is the gate, per batch row."""
    from qwen21_nodes.qwen21_core.dit.control import QuantizedSkip, add_skip
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    use_settings(quant_gemm=backend)
    g = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(256, 256)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(256, 256, generator=g) / 16)
        linear.bias.copy_(torch.randn(256, generator=g))
    skip = QuantizedSkip.from_linear(linear, FORMATS[fmt])
    h, c = torch.randn(2, 24, 256, generator=g), torch.randn(2, 24, 256, generator=g)
    with torch.no_grad():
        for strength in (1.0, 0.35):
            want = add_skip(h, linear, c, strength, None)
            gate = torch.full((2, 256), strength)
            got = add_skip(h, skip, c, strength, gate)
            change = want - h
            error = ((got - want).abs().max() / change.abs().max()).item()
            assert 0 < error < 0.05, (strength, error)
        gate = torch.tensor([[0.0] * 256, [1.0] * 256])  # the gate is per batch: row 0 unchanged
        got = add_skip(h, skip, c, 1.0, gate)
        assert torch.equal(got[0], h[0]) and not torch.equal(got[1], h[1])


def test_a_quantised_branch_steers_the_step_as_the_float_one_within_fp8(use_settings, models):
    """The controlled step with fp8 blocks and skips (emulated W8A8 on the CPU) against the float branch's."""
    import copy

    from qwen21_nodes.qwen21_core.dit.control import SKIP, QuantizedSkip, control_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    use_settings(quant_gemm="emulate")
    _, _, dit, net = models
    blocks = len(net.control_blocks)
    plan = control_plan(FORMATS["fp8"], blocks)
    assert sum(path == SKIP for _, path in plan) == blocks
    assert not any(path == SKIP for _, path in control_plan(FORMATS["fp8"], blocks, keep=[SKIP]))
    quant_net = copy.deepcopy(net).quantize_linears(plan)
    assert all(isinstance(skip, QuantizedSkip) for skip in quant_net.after_proj)
    mask, embeds, cond_tokens, x, context = _inputs()
    layout = build_layout(mask, [(4, 4)], (4, 6))
    t = torch.full((2,), 0.5)
    velocities = {}
    for name, control_net in (("float", net), ("fp8", quant_net), ("plain", None)):
        if control_net is None:
            branch = dit.new_branch(layout, 2)
        else:
            branch = _controlled_branch(dit, control_net, layout, 2, 0.8, context)
        dit.prefill(branch, embeds, cond_tokens)
        velocities[name] = dit.decode(branch, x, t)
    change = (velocities["float"] - velocities["plain"]).abs().max()
    assert change > 0.05 * velocities["plain"].abs().max()  # the control matters in this step
    error = ((velocities["fp8"] - velocities["float"]).abs().max() / change).item()
    assert 0 < error < 0.1, error


def _save(tmp_path, name, tensors):
    from safetensors.torch import save_file

    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def test_files_that_are_not_a_fun_control_for_this_dit_are_named(tiny_files, tmp_path):
    from qwen21_nodes.qwen21_core.checkpoints.files import CheckpointMismatchError, WrongModelError
    from qwen21_nodes.qwen21_core.checkpoints.loading import load_fun_control
    from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER

    def load(path):
        return load_fun_control(path, TINY_TRANSFORMER, "cpu", torch.float32)

    with pytest.raises(WrongModelError, match="Qwen-Image-2.1 transformer"):
        load(tiny_files["transformer"])  # the DiT itself
    released = _file_tensors(tiny_files["control"])
    older = {**released, "control_blocks.0.img_mod.1.weight": torch.zeros(4, 4)}
    with pytest.raises(WrongModelError, match="Fun ControlNet for Qwen-Image 1.x"):
        load(_save(tmp_path, "older.safetensors", older))
    wide = {k: torch.zeros([2 * s if s == 64 else s for s in v.shape]) for k, v in released.items()}
    with pytest.raises(WrongModelError, match=r"128 wide with 32-wide heads, for another model than this DiT \(64"):
        load(_save(tmp_path, "wide.safetensors", wide))
    narrow_in = {**released, "control_img_in.weight": torch.zeros(64, 65)}
    with pytest.raises(WrongModelError, match="takes 65 channels; Qwen-Image-2.1's Fun-Control takes 129"):
        load(_save(tmp_path, "channels.safetensors", narrow_in))
    gap = {k.replace("control_blocks.0.after_proj", "control_blocks.3.after_proj"): v for k, v in released.items()}
    with pytest.raises(CheckpointMismatchError, match="control blocks are numbered"):
        load(_save(tmp_path, "gap.safetensors", gap))


@pytest.mark.gpu
def test_a_controlled_step_replayed_from_a_cuda_graph_is_bit_identical_to_eager():
    """On the GPU in bf16: the controlled step (both streams, both caches) captured into a real CUDA graph replays the
    eager step's bits, and a new control image adopted in place is replayed too."""
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.dit.control import FunControlNet
    from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer

    config = TransformerConfig(**CONTROL_DIT)
    torch.manual_seed(0)
    dit = QwenImage21Transformer(config).eval().to("cuda", torch.bfloat16)
    net = FunControlNet(config, CONTROL_BLOCKS).eval().to("cuda", torch.bfloat16)
    mask, embeds, cond_tokens, x, context = _inputs()
    layout = build_layout(mask, [(4, 4)], (4, 6))
    graphs = DecodeGraphs(dit, launch_bound_share=0)
    control = Control(net, 0.9, image=DUMMY_IMAGE)
    for run, ctx in enumerate((context, context.flip(0))):
        branch = graphs.new_branch(layout, 2, "auto", "positive", control=control)
        branch.control.set_context(ctx, run)
        dit.prefill(branch, embeds.cuda(), cond_tokens.cuda())
        eager = dit.new_branch(layout, 2, control=control)
        eager.control.set_context(ctx)
        dit.prefill(eager, embeds.cuda(), cond_tokens.cuda())
        for t in (0.9, 0.4):
            xt = (x * t).to("cuda", torch.bfloat16)
            tt = torch.full((2,), t, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(graphs(branch, xt, tt), dit.decode(eager, xt, tt)), run
        graphs.release(branch)
        eager.release()
        graphs.end_generation()
    assert len(graphs.entries) == 1  # the second run adopted the first's entry


# ---------------------------------------------------------------------------------------------------------
# Memory: a streamed branch, and what a controlled run is sized for
# ---------------------------------------------------------------------------------------------------------


def _random_pair(seed=0):
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.dit.control import FunControlNet
    from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer

    config = TransformerConfig(**CONTROL_DIT)
    torch.manual_seed(seed)
    return QwenImage21Transformer(config).eval(), FunControlNet(config, CONTROL_BLOCKS).eval()


@pytest.mark.parametrize("resident", [0, 1])
def test_a_streamed_control_branch_gives_the_resident_step_exactly(resident):
    """On a small card the branch's blocks stream from RAM as the DiT's do (memory/streaming.py; on the CPU the same
    bookkeeping): the controlled step does not change."""
    dit, net = _random_pair()
    mask, embeds, cond_tokens, x, context = _inputs()
    layout = build_layout(mask, [(4, 4)], (4, 6))
    t = torch.full((2,), 0.6)

    def step():
        branch = _controlled_branch(dit, net, layout, 2, 0.9, context)
        dit.prefill(branch, embeds, cond_tokens)
        return dit.decode(branch, x, t)

    with torch.inference_mode():
        want = step()
        net.place("cpu", resident)
        try:
            assert net.resident_blocks == resident and net.streaming_signature() == tuple(range(resident, 2))
            got = step()
        finally:
            net.place("cpu")
    assert net.streamer is None and torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------
# The control blocks run ahead (QWEN21_CONTROL_STREAM): on the CPU the reordering, on the GPU a second stream
# ---------------------------------------------------------------------------------------------------------


def test_control_blocks_run_ahead_give_the_interleaved_step_bit_for_bit(monkeypatch):
    """The control chain enqueued before the base's blocks (on the CPU in order, the reordering the side stream
    makes), the base taking block k's output after base block 2k: the interleaved step exactly, every output taken
    once and nothing held after the step."""
    from qwen21_nodes.qwen21_core.dit.control import ControlState

    dit, net = _random_pair()
    mask, embeds, cond_tokens, x, context = _inputs()
    layout = build_layout(mask, [(4, 4)], (4, 6))
    branch = _controlled_branch(dit, net, layout, 2, 0.7, context)
    taken = []
    real_take = ControlState.take

    def take(self, k):
        taken.append(k)
        return real_take(self, k)

    with torch.inference_mode():
        dit.prefill(branch, embeds, cond_tokens)
        t = torch.full((2,), 0.6)
        want = dit.decode(branch, x, t)
        monkeypatch.setattr(ControlState, "runs_ahead", lambda self, h, base_streams: True)
        monkeypatch.setattr(ControlState, "take", take)
        got = dit.decode(branch, x, t)
    assert torch.equal(got, want)
    assert taken == list(range(CONTROL_BLOCKS)) and branch.control._ahead is None
    # an error in the middle of a step (out of memory in a base block): the step is ended, the next one works
    real_decode = type(dit.transformer_blocks[1]).decode

    def failing(self, *args, **kwargs):
        if self is dit.transformer_blocks[1]:
            raise torch.OutOfMemoryError("CUDA out of memory (made by the test)")
        return real_decode(self, *args, **kwargs)

    with torch.inference_mode():
        monkeypatch.setattr(type(dit.transformer_blocks[1]), "decode", failing)
        with pytest.raises(torch.OutOfMemoryError):
            dit.decode(branch, x, t)
        assert branch.control._ahead is None
        monkeypatch.setattr(type(dit.transformer_blocks[1]), "decode", real_decode)
        assert torch.equal(dit.decode(branch, x, t), want)


def test_the_control_blocks_run_ahead_only_where_asked_on_a_gpu_with_nothing_streamed(use_settings):
    """runs_ahead: off unless QWEN21_CONTROL_STREAM=1, and even then only for CUDA tensors with no block of either
    model streaming and the control cache on the GPU."""
    dit, net = _random_pair()
    mask, _, _, _, context = _inputs()
    branch = _controlled_branch(dit, net, build_layout(mask, [(4, 4)], (4, 6)), 2, 0.7, context)
    on_cpu, on_gpu = torch.zeros(1), type("CudaTensor", (), {"is_cuda": True})()  # runs_ahead reads is_cuda only
    use_settings(control_stream=True)
    assert not branch.control.runs_ahead(on_cpu, base_streams=False)
    assert branch.control.runs_ahead(on_gpu, base_streams=False)
    assert not branch.control.runs_ahead(on_gpu, base_streams=True)
    net.stream_blocks(1)  # some control blocks stream
    try:
        assert net.streamer is not None and not branch.control.runs_ahead(on_gpu, base_streams=False)
    finally:
        net.place("cpu")
    branch.control.cache.placement = "cpu"
    assert not branch.control.runs_ahead(on_gpu, base_streams=False)
    branch.control.cache.placement = "gpu"
    use_settings(control_stream=False)
    assert not branch.control.runs_ahead(on_gpu, base_streams=False)


def test_a_control_stream_run_is_sized_for_the_outputs_it_holds(use_settings):
    """With QWEN21_CONTROL_STREAM=1 a controlled run asks for one image-row activation per control block more and a
    second step's working set (memory/sizing.py); a plain run asks for what it did."""
    from qwen21_nodes.qwen21_core.memory import sizing

    dit, _ = _random_pair()
    args = (dit.config, torch.bfloat16, [40], 256, 1)
    _, before = sizing.job_bytes(*args, control_layers=CONTROL_BLOCKS)
    _, plain_before = sizing.job_bytes(*args)
    use_settings(control_stream=True)
    _, after = sizing.job_bytes(*args, control_layers=CONTROL_BLOCKS)
    _, plain_after = sizing.job_bytes(*args)
    unit = 256 * dit.config.inner_dim * 2
    assert after - before == (CONTROL_BLOCKS + sizing.ACTIVATION_FACTOR) * unit and plain_after == plain_before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none (run on the H200)")
def test_control_blocks_on_a_second_stream_give_the_one_stream_step_bit_for_bit(use_settings):
    """On the GPU in bf16 with QWEN21_CONTROL_STREAM=1: the control blocks run on the side stream (its events waited
    for by the base), eager and captured into a real CUDA graph, and the step is the one-stream step's bits."""
    from qwen21_nodes.qwen21_core.dit import control as control_module

    dit, net = _random_pair()
    dit, net = dit.to("cuda", torch.bfloat16), net.to("cuda", torch.bfloat16)
    mask, embeds, cond_tokens, x, context = _inputs()
    layout = build_layout(mask, [(4, 4)], (4, 6))
    xt = (x * 0.6).to("cuda", torch.bfloat16)
    tt = torch.full((2,), 0.6, device="cuda", dtype=torch.bfloat16)
    branch = _controlled_branch(dit, net, layout, 2, 0.9, context)
    dit.prefill(branch, embeds.cuda(), cond_tokens.cuda())
    want = dit.decode(branch, xt, tt)
    use_settings(control_stream=True)
    sides = []
    real = control_module.side_stream

    def side(device):
        sides.append(real(device))
        return sides[-1]

    control_module.side_stream, restore = side, real
    try:
        for _ in range(3):  # memory the side stream freed is reused in the later steps
            assert torch.equal(dit.decode(branch, xt, tt), want)
        graphs = DecodeGraphs(dit, launch_bound_share=0)
        captured = graphs.new_branch(layout, 2, "auto", "positive", control=Control(net, 0.9, image=DUMMY_IMAGE))
        captured.control.set_context(context.cuda())
        dit.prefill(captured, embeds.cuda(), cond_tokens.cuda())
        for _ in range(3):
            assert torch.equal(graphs(captured, xt, tt), want)
        graphs.release(captured)
    finally:
        control_module.side_stream = restore
    assert sides and all(s is sides[0] for s in sides) and sides[0] != torch.cuda.current_stream()


@pytest.mark.parametrize("start,end", [(0.0, 1.0), (0.25, 0.5)])
def test_a_controlled_run_is_sized_for_what_its_branches_allocate(start, end):
    """memory/sizing.py counts a controlled branch's caches (the control blocks' K/V, the stream's start) and, where
    plain steps lie on both sides of the range, a plain branch beside: exactly what the branches hold."""
    from qwen21_nodes.qwen21_core.memory import sizing
    from qwen21_nodes.qwen21_core.request import SampleRequest

    dit, net = _random_pair()
    mask, embeds, _, _, context = _inputs(condition_shapes=(), target=(4, 4), batch=1)
    cond = Conditioning(PromptEmbedding(embeds, mask))
    control = Control(net, 1.0, start, end, image=DUMMY_IMAGE)
    request = SampleRequest(height=64, width=64, steps=4, control=control)
    caches, _ = sizing.request_bytes(dit.config, dit.dtype, cond, request)
    layout = build_layout(mask, [], (4, 4))
    controlled = dit.new_branch(layout, 1, control=control)
    held = controlled.cache_bytes + (dit.new_branch(layout, 1).cache_bytes if start > 0 and end < 1 else 0)
    assert caches["gpu"] == held
    plain, _ = sizing.request_bytes(dit.config, dit.dtype, cond, request.replace(control=None))
    assert caches["gpu"] > plain["gpu"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none (run on the H200)")
@pytest.mark.parametrize("fmt", ["none", "fp8"])
def test_a_branch_loaded_under_inference_mode_runs_after_the_manager_places_it(tiny_files, fmt):
    """Inside ComfyUI the loader node runs under inference mode, so the branch's parameters are inference tensors in
    RAM; placed on the GPU whole (the memory manager's load) they must be normal tensors there, or the first
    controlled step outside inference mode fails ("Inference tensors do not track version counter"), as every
    controlled prompt through ComfyUI on a GPU did before move_layer."""
    from qwen21_nodes.qwen21_core.checkpoints.loading import load_fun_control
    from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER

    with torch.inference_mode():
        net, _ = load_fun_control(tiny_files["control"], TINY_TRANSFORMER, "cpu", torch.bfloat16, weight_format=fmt)
    assert any(p.is_inference() for p in net.parameters())
    net.place(torch.device("cuda"))
    assert not [name for name, p in net.named_parameters() if p.is_inference() or p.device.type != "cuda"]
    block = net.control_blocks[0]
    x = torch.randn(1, 8, TINY_TRANSFORMER.inner_dim, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():  # outside inference mode, as the sampler's graphs run
        assert torch.isfinite(block.attn.to_out[0](x)).all()
