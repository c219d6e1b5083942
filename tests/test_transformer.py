"""The DiT against diffusers' QwenImage21Transformer2DModel on the same tiny random weights (fp32, CPU)."""

import pytest
import torch
from dit_reference import CHANNELS, CONTEXT, TINY_DIT, our_dit, prompt_mask, reference_dit, reference_velocity
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit.sequence import (
    ROPE_MAX_POSITION,
    build_layout,
    check_rotary_range,
    prefix_rotary_range,
)
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer

pytest.importorskip("diffusers")

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def models():
    ref = reference_dit()
    return ref, our_dit(ref)


def _inputs(condition_shapes, target_shape, batch=1, seed=1):
    g = torch.Generator().manual_seed(seed)
    mask = prompt_mask(5, condition_shapes)
    embeds = torch.randn(mask.shape[0], CONTEXT, generator=g)
    tokens = sum(h * w for h, w in condition_shapes)
    cond = torch.randn(tokens, CHANNELS, generator=g) if condition_shapes else None
    x = torch.randn(batch, target_shape[0] * target_shape[1], CHANNELS, generator=g)
    return mask, embeds, cond, x


def _ours(model, mask, embeds, cond, condition_shapes, target_shape, x, t, text_valid=None):
    layout = build_layout(mask, condition_shapes, target_shape, text_valid=text_valid)
    branch = model.new_branch(layout, batch=x.shape[0])
    model.prefill(branch, embeds, cond)
    return model.decode(branch, x, t), branch


def test_full_size_checkpoint_keys_match_the_reference():
    from diffusers import QwenImage21Transformer2DModel

    with torch.device("meta"):
        ref = QwenImage21Transformer2DModel()
        ours = QwenImage21Transformer(TransformerConfig())
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    our_shapes = {k: tuple(v.shape) for k, v in ours.checkpoint_slots().items()}
    assert len(our_shapes) == 297
    assert our_shapes == ref_shapes


@pytest.mark.parametrize(
    "condition_shapes, target_shape",
    [([], (4, 6)), ([(4, 4)], (4, 6)), ([(4, 4), (2, 6)], (6, 4)), ([(6, 2), (2, 2)], (2, 8))],
    ids=["t2i", "1 image", "2 images", "2 images, odd layout"],
)
def test_decode_matches_reference_full_forward(models, condition_shapes, target_shape):
    ref, ours = models
    mask, embeds, cond, x = _inputs(condition_shapes, target_shape)
    t = torch.full((1,), 0.6)
    expected = reference_velocity(ref, embeds, mask, cond, condition_shapes, x, t, target_shape=target_shape)
    got, _ = _ours(ours, mask, embeds, cond, condition_shapes, target_shape, x, t)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= FP32_TOL


def test_prefix_cache_holds_the_reference_keys_and_values(models):
    """Our prefill stores the same post-norm, post-RoPE prefix K/V as the reference's extract mode."""
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

    ref, ours = models
    shapes, target = [(4, 4), (2, 6)], (4, 4)
    mask, embeds, cond, x = _inputs(shapes, target)
    cache = QwenImage21KVCache(len(ref.transformer_blocks))
    reference_velocity(
        ref, embeds, mask, cond, shapes, x, torch.ones(1), target_shape=target, kv_cache=cache, kv_cache_mode="extract"
    )
    _, branch = _ours(ours, mask, embeds, cond, shapes, target, x, torch.ones(1))
    for layer in range(len(ref.transformer_blocks)):
        ref_k, ref_v = cache.get_layer(layer).get()
        our_k, our_v = branch.cache.prefix(layer)
        assert (our_k - ref_k).abs().max() <= FP32_TOL
        assert (our_v - ref_v).abs().max() <= FP32_TOL


def test_padded_prompt_mask_matches_reference(models):
    ref, ours = models
    shapes, target = [(4, 4)], (4, 6)
    mask, embeds, cond, x = _inputs(shapes, target)
    mask = torch.cat([mask, torch.zeros(3, dtype=torch.bool)])  # three padded prompt tokens at the end
    embeds = torch.cat([embeds, torch.randn(3, CONTEXT)])
    valid = torch.ones(mask.shape[0], dtype=torch.bool)
    valid[-3:] = False
    t = torch.full((1,), 0.3)
    expected = reference_velocity(
        ref, embeds, mask, cond, shapes, x, t, target_shape=target, encoder_hidden_states_mask=valid[None]
    )
    got, _ = _ours(ours, mask, embeds, cond, shapes, target, x, t, text_valid=valid)
    assert (got - expected).abs().max().item() <= FP32_TOL
    # and the padded values really are ignored
    embeds[-3:] = 100.0
    again, _ = _ours(ours, mask, embeds, cond, shapes, target, x, t, text_valid=valid)
    assert torch.equal(again, got)


def test_decode_steps_reuse_the_prefix_bit_identically(models):
    """Cache on (prefill once) and cache off (prefill every step) give identical velocities in fp32."""
    _, ours = models
    shapes, target = [(4, 4)], (4, 6)
    mask, embeds, cond, x = _inputs(shapes, target)
    layout = build_layout(mask, shapes, target)
    cached = ours.new_branch(layout)
    ours.prefill(cached, embeds, cond)
    for t in (0.9, 0.5, 0.1):
        tt = torch.full((1,), t)
        fresh = ours.new_branch(layout)
        ours.prefill(fresh, embeds, cond)
        assert torch.equal(ours.decode(cached, x * t, tt), ours.decode(fresh, x * t, tt))


def test_batch_shares_one_prefix_and_matches_single_rows(models):
    _, ours = models
    shapes, target = [(4, 4)], (4, 6)
    mask, embeds, cond, x = _inputs(shapes, target, batch=3)
    t = torch.tensor([0.8, 0.5, 0.2])
    batched, branch = _ours(ours, mask, embeds, cond, shapes, target, x, t)
    assert branch.cache.shared_prefix
    k_prefix, _ = branch.cache.prefix(0)
    assert k_prefix.shape[0] == 1  # stored once, not per row
    for row in range(3):
        single, _ = _ours(ours, mask, embeds, cond, shapes, target, x[row : row + 1], t[row : row + 1])
        assert (batched[row] - single[0]).abs().max().item() <= 1e-6


def test_bf16_agrees_with_fp32_reference(models):
    """bf16 weights and activations: within 0.05 of the fp32 reference (unit-scale outputs)."""
    ref, ours = models
    shapes, target = [(4, 4)], (4, 6)
    mask, embeds, cond, x = _inputs(shapes, target)
    t = torch.full((1,), 0.7)
    expected = reference_velocity(ref, embeds, mask, cond, shapes, x, t, target_shape=target)
    half = QwenImage21Transformer(TransformerConfig(**TINY_DIT)).eval()
    half.load_diffusers_state_dict(ref.state_dict())
    half.to(torch.bfloat16)
    got, _ = _ours(half, mask, embeds, cond, shapes, target, x, t)
    assert got.dtype == torch.bfloat16
    err = (got.float() - expected).abs().max().item()
    assert err <= 0.05, err
    assert err > 0  # it really ran in bf16


def test_adjacent_condition_images_stay_separate_blocks():
    mask = torch.tensor([False] * 2 + [True] * (4 + 2) + [False] * 3)
    layout = build_layout(mask, [(4, 4), (2, 4)], (2, 2))
    images = [(s.start, s.end) for s in layout.segments if not s.is_text]
    assert images == [(2, 18), (18, 26)]


def test_rope_positions_past_the_table_are_an_error():
    mask = torch.zeros(8200, dtype=torch.bool)
    with pytest.raises(ValueError, match="outside the model's table"):
        build_layout(mask, [], (2, 2))


@pytest.mark.parametrize("below", [64, 63, 8, 7, 0, -1])
@pytest.mark.parametrize("shapes", [[], [(64, 48)], [(4, 4), (2, 4)]])
def test_the_encoders_rotary_range_is_the_layouts(below, shapes):
    """The encoder judges a prompt by prefix_rotary_range, without laying it out: it must agree with the layout the
    sampler builds, at the edge of the table too (the target sits at the position the prefix reaches)."""
    text = ROPE_MAX_POSITION - below
    slots = [torch.ones(h * w // 4, dtype=torch.bool) for h, w in shapes]
    mask = torch.cat([torch.zeros(text, dtype=torch.bool), *slots])
    prefix = len(mask) + 3 * int(mask.sum())
    low, high = prefix_rotary_range(text, shapes)
    if high > ROPE_MAX_POSITION:
        with pytest.raises(ValueError, match=rf"rotary position {high} is outside .* \({prefix} prefix tokens\)"):
            build_layout(mask, shapes, (1, 1))
        with pytest.raises(ValueError, match=rf"rotary position {high} is outside .* \({prefix} prefix tokens\)"):
            check_rotary_range(low, high, prefix)
        return
    positions = build_layout(mask, shapes, (1, 1)).positions
    assert int(positions.max()) == high and int(positions[:-1].min()) == low  # the last row: the 1x1 target


def test_slot_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="image slots"):
        build_layout(prompt_mask(3, [(4, 4)]), [(4, 6)], (2, 2))


def test_state_dict_errors_name_the_keys(models):
    ref, _ = models
    model = QwenImage21Transformer(TransformerConfig(**TINY_DIT))
    sd = dict(ref.state_dict())
    sd.pop("proj_out.weight")
    sd["extra.weight"] = torch.zeros(1)
    expected = r"missing \(e.g. \['proj_out.weight'\]\).*unexpected \(e.g. \['extra.weight'\]\)"
    with pytest.raises(ValueError, match=expected):
        model.load_diffusers_state_dict(sd)
    sd = dict(ref.state_dict())
    sd["img_in.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"img_in.weight: checkpoint shape \(3, 3\), model shape \(64, 16\)"):
        model.load_diffusers_state_dict(sd)


def test_decode_before_prefill_is_an_error(models):
    _, ours = models
    layout = build_layout(prompt_mask(3, []), [], (2, 2))
    branch = ours.new_branch(layout)
    with pytest.raises(RuntimeError, match="before prefill"):
        ours.decode(branch, torch.zeros(1, 4, CHANNELS), torch.ones(1))


@pytest.mark.gpu
@pytest.mark.parametrize("p", [77, 1100])  # a text-only prefix (flash) and a longer one (cuDNN)
def test_shared_prefix_attention_matches_joint_attention_on_cuda(p):
    """The LSE merge (cuDNN or flash with log-sum-exp) equals one SDPA over [prefix | target] per row."""
    from qwen21_nodes.qwen21_core.dit.attention import decode_attention, shared_prefix_decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    b, n, h, d = 3, 256, 4, 128
    q, k_t, v_t = (torch.randn(b, n, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    k_p, v_p = (torch.randn(1, p, h, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    merged = shared_prefix_decode_attention(q, k_p, v_p, k_t, v_t)
    joint_k = torch.cat([k_p.expand(b, -1, -1, -1), k_t], 1)
    joint_v = torch.cat([v_p.expand(b, -1, -1, -1), v_t], 1)
    expected = decode_attention(q, joint_k, joint_v)
    assert merged.shape == expected.shape and merged.dtype == torch.bfloat16
    assert (merged.float() - expected.float()).abs().max().item() <= 2e-2


def test_text_runs_use_torchs_lower_right_causal_bias_on_cuda_and_the_same_mask_elsewhere():
    """On CUDA a text run's triangle is torch's lower-right causal bias (the flash kernel runs it; a boolean mask
    would send SDPA to cuDNN or the efficient kernel): it must be exactly the boolean mask used on the CPU."""
    from qwen21_nodes.qwen21_core.dit.attention import prefix_masks
    from qwen21_nodes.qwen21_core.dit.sequence import Segment

    segments = (Segment(0, 5, True), Segment(5, 21, False), Segment(21, 28, True))
    on_cpu = prefix_masks(segments, None, "cpu")
    on_cuda = prefix_masks(segments, None, torch.device("cuda"))  # builds nothing on the device
    assert on_cpu[1] is None and on_cuda[1] is None
    for cpu_mask, bias in ((on_cpu[0], on_cuda[0]), (on_cpu[2], on_cuda[2])):
        assert type(bias).__name__ == "CausalBias"
        assert torch.equal(bias._materialize("cpu"), cpu_mask[0, 0])
    valid = torch.ones(28, dtype=torch.bool)
    valid[2] = False  # a padded prompt token: a boolean mask that also hides it, on every device
    padded = prefix_masks(segments, valid, "cpu")
    assert padded[0].dtype == torch.bool and not padded[0][0, 0, :, 2].any()


def test_the_prefill_keeps_sdpa_off_cudnn_and_the_decode_step_keeps_torchs_choice():
    """A changed prompt's prefill meets new shapes, where cuDNN plans on the host (~50 ms on the H200): "auto" keeps
    SDPA off it there, and only there (a decode step's shapes repeat; cuDNN was up to 2x faster on them). The flags
    come back as they were afterwards (ComfyUI's other nodes share them); a user's explicit choice is kept."""
    from qwen21_nodes.qwen21_core.dit.attention import PLANNED_KERNELS, backend_context, prefix_kernels

    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
    with backend_context("auto", prefill=True):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before
    with backend_context("auto"):
        assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before
    with backend_context("cudnn", prefill=True):
        assert torch.backends.cuda.cudnn_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    # the decode step's prefix half: flash over a text-only prefix (a new length at every prompt), cuDNN first over
    # a prefix with condition images (4096+ keys at 1024^2), as over the target's own keys
    assert prefix_kernels(120)[0] == "flash" and prefix_kernels(4196) == PLANNED_KERNELS == ("cudnn", "flash")


@pytest.mark.gpu
def test_text_runs_on_cuda_attend_as_their_boolean_masks_do():
    """On CUDA the prefill's text runs go through torch's lower-right causal bias (flash, no mask in memory); a text
    run after an image block sees every key before it and its own keys causally, exactly what the boolean mask
    says. Both ways on the GPU must agree (bf16; different kernels, so to a tolerance)."""
    from qwen21_nodes.qwen21_core.dit.attention import backend_context, prefix_attention, prefix_masks
    from qwen21_nodes.qwen21_core.dit.sequence import Segment

    segments = (Segment(0, 37, True), Segment(37, 293, False), Segment(293, 331, True))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 331, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    boolean = [None if m is None else m.to("cuda") for m in prefix_masks(segments, None, "cpu")]
    with backend_context("auto", prefill=True):
        biased = prefix_attention(q, k, v, segments, prefix_masks(segments, None, "cuda"), torch.empty_like(q))
        masked = prefix_attention(q, k, v, segments, boolean, torch.empty_like(q))
    assert (biased.float() - masked.float()).abs().max().item() <= 2e-2
