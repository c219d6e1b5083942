"""The VAE against diffusers' AutoencoderKLQwenImage21: checkpoint slots, exact decode/encode (bit-identical in
fp32 on CPU), precision options with the fp16 overflow guard, and quality="fast" against exact.

Tolerances stated here:
* exact fp32 decode and encode: torch.equal with the reference (RGBA and RGB input, several sizes);
* fast vs exact, fp32 (tiny VAE): max |diff| <= 1e-4 on [-1, 1] pixels (observed ~3e-6);
* bf16 / fp16 decode vs fp32 decode (tiny VAE, fp32 weights): PSNR >= 35 / 45 dB on 0..1 images.
"""

from __future__ import annotations

import pytest
import torch
from qwen21_nodes.qwen21_core.config import VAEConfig
from qwen21_nodes.qwen21_core.vae import model as vae_module
from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE
from qwen21_nodes.qwen21_core.vae.tiling import live_tensor_peak
from vae_reference import TINY_VAE, our_vae, psnr, vae_pair

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def pair():
    return vae_pair(TINY_VAE, seed=0)


def _ref_decode(ref, z):
    with torch.no_grad():
        return ref.decode(z[:, :, None]).sample[:, :, 0]


def _ref_encode_mean(ref, images_bhwc):
    x = (2.0 * images_bhwc.permute(0, 3, 1, 2) - 1.0).contiguous()  # the reference image processor, NCHW
    with torch.no_grad():
        return ref.encode(x[:, :, None]).latent_dist.mode()[:, :, 0]


# ---------------------------------------------------------------------------------------------------------
# Checkpoint slots
# ---------------------------------------------------------------------------------------------------------


def test_checkpoint_slots_cover_every_released_key_with_matching_shapes():
    from diffusers import AutoencoderKLQwenImage21

    with torch.device("meta"):
        ref = AutoencoderKLQwenImage21()
        ours = QwenImage21VAE(VAEConfig())
    ref_shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    slots = ours.checkpoint_slots()
    assert len(ref_shapes) == 238
    assert set(slots) == set(ref_shapes)
    dropped = {k for k, v in slots.items() if v is None}
    assert dropped == {k for k in ref_shapes if ".time_conv." in k} and len(dropped) == 12
    for key, slot in slots.items():
        if slot is not None:
            assert tuple(slot.shape) == ref_shapes[key], key
        else:
            assert ours.dropped_checkpoint_keys()[key] == ref_shapes[key], key
    assert list(ours.buffers()) == []  # nothing to initialise after to_empty
    assert not any("time_conv" in name for name, _ in ours.named_parameters())
    assert sum(p.numel() for p in slots.values() if p is not None) == sum(
        n for k, n in ((k, v.numel()) for k, v in ref.state_dict().items()) if ".time_conv." not in k
    )


def test_meta_build_then_to_empty_and_slot_copy_loads_completely(pair):
    ours, ref = pair
    with torch.device("meta"):
        fresh = QwenImage21VAE(TINY_VAE)
    fresh.to_empty(device="cpu")
    slots = fresh.checkpoint_slots()
    with torch.no_grad():
        for key, tensor in ref.state_dict().items():
            if slots[key] is not None:
                slots[key].copy_(tensor)
    z = torch.randn(1, 4, 3, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fresh.eval().decode_pixels(z), ours.decode_pixels(z))


def test_load_rejects_missing_unexpected_and_misshaped_keys(pair):
    _, ref = pair
    state = dict(ref.state_dict())
    vae = QwenImage21VAE(TINY_VAE)

    missing = {k: v for k, v in state.items() if k != "decoder.conv_in.bias"}
    with pytest.raises(ValueError, match=r"1 missing keys \['decoder.conv_in.bias'\]"):
        vae.load_diffusers_state_dict(missing)
    assert vae.load_diffusers_state_dict(missing, strict=False) == (["decoder.conv_in.bias"], [])

    with pytest.raises(ValueError, match=r"1 unexpected keys \['decoder.extra.weight'\]"):
        vae.load_diffusers_state_dict({**state, "decoder.extra.weight": torch.zeros(1)})

    bad = {**state, "decoder.conv_in.weight": torch.zeros(3, 3, 3, 3)}
    with pytest.raises(ValueError, match=r"decoder.conv_in.weight: checkpoint \(3, 3, 3, 3\), model \(48, 4, 3, 3\)"):
        vae.load_diffusers_state_dict(bad, strict=False)
    bad_time_conv = {**state, "decoder.up_blocks.0.upsampler.time_conv.bias": torch.zeros(5)}
    with pytest.raises(ValueError, match="time_conv.bias"):
        vae.load_diffusers_state_dict(bad_time_conv)


def test_unsupported_config_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="in/out_channels must be 4"):
        QwenImage21VAE(VAEConfig(in_channels=3, out_channels=3))
    with pytest.raises(ValueError, match="is_residual"):
        QwenImage21VAE(VAEConfig(is_residual=False))


# ---------------------------------------------------------------------------------------------------------
# Exact mode: bit-identical to the reference in fp32
# ---------------------------------------------------------------------------------------------------------


def test_padded_buffers_take_the_layout_of_f_pad():
    # The conv after a norm reads a buffer the norm wrote into; its layout picks the conv kernel, so it must
    # be the one F.pad would have produced, for every dense stride order (and torch's size-1 tie-breaks).
    import itertools

    from qwen21_nodes.qwen21_core.vae.model import zero_bordered_empty

    for shape in ((2, 5, 4, 3), (1, 5, 1, 1), (2, 1, 4, 1), (1, 3, 1, 4)):
        base = torch.randn(shape)
        for order in itertools.permutations(range(4)):
            x = base.permute(order).contiguous().permute([order.index(d) for d in range(4)])
            want = torch.nn.functional.pad(x, (1, 2, 0, 1))
            padded, interior = zero_bordered_empty(x, (1, 2, 0, 1))
            assert padded.stride() == want.stride(), (shape, order)
            interior.copy_(x)
            assert torch.equal(padded, want)


@pytest.mark.parametrize("shape", [(1, 4, 4, 4), (2, 4, 3, 5), (1, 4, 6, 2)])
def test_exact_decode_is_bit_identical_to_diffusers(pair, shape):
    ours, ref = pair
    z = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    want = _ref_decode(ref, z)
    assert (want.abs() < 1).float().mean() > 0.95  # outputs mostly unclamped: the comparison sees the math
    assert torch.equal(ours.decode_pixels(z), want)

    images = ours.decode(z)
    assert images.shape == (shape[0], 16 * shape[2], 16 * shape[3], 4) and images.dtype == torch.float32
    assert images.is_contiguous()
    assert torch.equal(images, (want * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1))
    info = ours.last_decode_info
    assert info == {"tiled": False, "tiles": 1, "tile_size": None, "batch_chunk": shape[0], "oom_retries": 0,
                    "quality": "exact", "precision": "fp32"}  # fmt: skip


@pytest.mark.parametrize("channels", [4, 3])
@pytest.mark.parametrize("size", [(64, 64), (48, 96)])
def test_exact_encode_is_bit_identical_to_diffusers(pair, channels, size):
    ours, ref = pair
    images = torch.rand(2, *size, 4, generator=torch.Generator().manual_seed(size[0] + channels))
    if channels == 3:
        images_in, images_ref = images[..., :3], torch.cat([images[..., :3], torch.ones_like(images[..., :1])], -1)
    else:
        images_in, images_ref = images, images
    latents = ours.encode(images_in)
    assert latents.shape == (2, TINY_VAE.z_dim, size[0] // 16, size[1] // 16)
    assert torch.equal(latents, _ref_encode_mean(ref, images_ref))
    assert ours.last_encode_info["tiled"] is False


def test_no_temporal_caches_the_live_activation_peak_is_a_fraction_of_the_reference(pair):
    """The reference keeps a copy of every conv input for frames that never come; ours keeps nothing.
    Observed on this tiny model (fp32): decode 34%, encode 46% of the reference's peak of live tensors."""
    ours, ref = pair
    z = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(11))
    ours_peak = live_tensor_peak(lambda: ours.decode_pixels(z))
    assert ours_peak <= 0.5 * live_tensor_peak(lambda: ref.decode(z[:, :, None]))
    x = torch.rand(1, 4, 256, 256, generator=torch.Generator().manual_seed(12)) * 2 - 1
    assert live_tensor_peak(lambda: ours.encode_pixels(x)) <= 0.6 * live_tensor_peak(lambda: ref.encode(x[:, :, None]))


def test_normalize_and_denormalize_follow_the_pipeline(pair):
    ours, ref = pair
    raw = torch.randn(2, 4, 3, 3)
    mean = torch.tensor(ref.config.latents_mean).view(1, 4, 1, 1)
    std = torch.tensor(ref.config.latents_std).view(1, 4, 1, 1)
    assert torch.equal(ours.normalize(raw), (raw - mean) / std)
    assert torch.equal(ours.denormalize(raw), raw * std + mean)
    assert torch.allclose(ours.denormalize(ours.normalize(raw)), raw, atol=1e-6)


def test_decode_returns_on_the_latents_device_and_validates_input(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match=r"latents must be a tensor \[B, 4, h, w\]"):
        ours.decode(torch.zeros(1, 64, 2, 2))
    with pytest.raises(TypeError, match="float"):
        ours.decode(torch.zeros(1, 4, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="precision must be"):
        ours.decode(torch.zeros(1, 4, 2, 2), precision="fp8")
    with pytest.raises(ValueError, match="tiling must be"):
        ours.decode(torch.zeros(1, 4, 2, 2), tiling="sometimes")
    with pytest.raises(ValueError, match="quality must be"):
        ours.decode(torch.zeros(1, 4, 2, 2), quality="best")
    with pytest.raises(ValueError, match=r"multiples of 16, got 40x64; crop or resize to e.g. 32x64"):
        ours.encode(torch.rand(1, 40, 64, 4))
    with pytest.raises(ValueError, match=r"\[B, H, W, 3 or 4\]"):
        ours.encode(torch.rand(1, 4, 64, 64))


# ---------------------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------------------


def test_decode_precision_is_independent_of_the_weights_dtype(pair):
    ours, _ = pair
    z = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(5))
    full = ours.decode(z)
    bf16 = ours.decode(z, precision="bf16")
    fp16 = ours.decode(z, precision=torch.float16)
    assert ours.dtype == torch.float32  # the weights stay as they are
    assert ours.last_decode_info["precision"] == "fp16"
    assert not torch.equal(bf16, full) and not torch.equal(fp16, full)
    assert psnr(bf16, full) >= 35 and psnr(fp16, full) >= 45

    # A bf16 VAE decoding in fp32 computes with its own (bf16) weights in fp32 arithmetic.
    half = QwenImage21VAE(TINY_VAE)
    half.load_state_dict(ours.state_dict())
    half = half.to(torch.bfloat16)
    rounded = QwenImage21VAE(TINY_VAE)
    rounded.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    assert torch.equal(half.decode(z, precision="fp32"), rounded.decode(z))
    assert half.dtype == torch.bfloat16


def _blow_up_(vae):
    """Scale one mid-block conv so that the residual stream leaves the fp16 range (> 65504)."""
    with torch.no_grad():
        vae.decoder.mid_block.resnets[0].conv2.weight.mul_(3e5)
        vae.decoder.mid_block.resnets[0].conv2.bias.mul_(3e5)


def test_fp16_guard_keeps_large_activations_finite(monkeypatch):
    vae = our_vae(TINY_VAE, seed=2)
    _blow_up_(vae)
    z = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(6))

    peak = []
    hook = vae.decoder.mid_block.attentions[0].register_forward_pre_hook(
        lambda module, args: peak.append(args[0].abs().max().item())
    )
    with torch.no_grad():
        full = vae.decode_pixels(z)
    hook.remove()
    assert peak[0] > 1e5  # fp32 activations really exceed fp16's range

    images = vae.decode(z, precision="fp16")
    assert torch.isfinite(images).all()
    assert psnr(images, (full * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1)) > 20  # clamped, not garbage

    # Without the guard the same decode produces inf/NaN: the test would catch a missing guard.
    monkeypatch.setattr(vae_module, "fp16_guard_", lambda x: x)
    with torch.no_grad():
        unguarded = vae.decode_pixels(z.half(), vae.ops_for("exact"))
    assert not torch.isfinite(unguarded).all()


# ---------------------------------------------------------------------------------------------------------
# quality="fast"
# ---------------------------------------------------------------------------------------------------------


def test_fast_decode_is_close_to_exact_and_leaves_the_model_untouched(pair):
    ours, _ = pair
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    strides = {k: v.stride() for k, v in ours.state_dict().items()}
    z = torch.randn(2, 4, 3, 5, generator=torch.Generator().manual_seed(7))
    exact = ours.decode_pixels(z)
    ops = ours.ops_for("fast")
    assert len(ops.foldable) == len(TINY_VAE.dim_mult) - 1  # every upsampler folded
    fast = ours.decode_pixels(z, ops)
    assert fast.is_contiguous(memory_format=torch.channels_last)
    assert not torch.equal(fast, exact)  # it really takes other paths
    assert (fast - exact).abs().max() <= 1e-4

    images = ours.decode(z, quality="fast")
    assert ours.last_decode_info["quality"] == "fast" and images.is_contiguous()
    assert psnr(images, ours.decode(z)) > 60
    after = ours.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) and after[k].stride() == strides[k] for k in before)
    assert torch.equal(ours.decode_pixels(z), exact)  # exact mode is unaffected afterwards


def test_fast_folds_only_structurally_matching_upsamplers(pair):
    ours, _ = pair
    vae = QwenImage21VAE(TINY_VAE)
    vae.load_state_dict(ours.state_dict())
    odd = vae.decoder.up_blocks[1].upsampler
    odd.resample[0] = torch.nn.Upsample(scale_factor=2.0, mode="bilinear")  # not a nearest upsampler
    ops = vae.ops_for("fast")
    assert id(odd) not in ops.foldable and len(ops.foldable) == len(TINY_VAE.dim_mult) - 2
    z = torch.randn(1, 4, 3, 3, generator=torch.Generator().manual_seed(8))
    # The unfoldable block runs the exact upsample + conv; the result stays close to exact.
    assert (vae.decode_pixels(z, ops) - vae.decode_pixels(z)).abs().max() <= 1e-4


def test_folded_upsample_conv_equals_upsample_then_conv():
    from qwen21_nodes.qwen21_core.vae.fast import fold_upsample_conv_weight

    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 5, 7, 6, generator=gen, dtype=torch.float64)
    conv = torch.nn.Conv2d(5, 3, 3, padding=1).double()
    want = conv(torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest"))
    folded = fold_upsample_conv_weight(conv.weight, torch.float64)
    got = torch.nn.functional.conv_transpose2d(x, folded, conv.bias, stride=2, padding=1)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# On the GPU (skipped without CUDA)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_is_bit_identical_to_diffusers_on_the_gpu(dtype):
    ours, ref = vae_pair(TINY_VAE, seed=13)
    ours, ref = ours.to("cuda", dtype), ref.to("cuda", dtype)
    z = torch.randn(2, 4, 5, 7, generator=torch.Generator().manual_seed(14)).to("cuda", dtype)
    assert torch.equal(ours.decode_pixels(z), _ref_decode(ref, z))
    images = torch.rand(2, 64, 80, 4, generator=torch.Generator().manual_seed(15)).cuda()
    pixels = (2.0 * images.permute(0, 3, 1, 2) - 1.0).to(dtype).contiguous()
    with torch.no_grad():
        want = ref.encode(pixels[:, :, None]).latent_dist.mode()[:, :, 0]
    assert torch.equal(ours.encode(images), want)


@pytest.mark.gpu
def test_fast_decode_on_the_gpu_is_close_to_exact():
    ours = our_vae(TINY_VAE, seed=16).to("cuda", torch.bfloat16)
    z = torch.randn(1, 4, 8, 6, generator=torch.Generator().manual_seed(17)).to("cuda", torch.bfloat16)
    exact = ours.decode(z)
    fast = ours.decode(z, quality="fast")
    assert ours.last_decode_info["quality"] == "fast"
    assert psnr(fast, exact) >= 40
    assert torch.equal(ours.decode(z), exact)


def test_fast_session_touches_only_the_cudnn_benchmark_flag():
    from qwen21_nodes.qwen21_core.vae.fast import _cudnn_benchmark

    cudnn = torch.backends.cudnn
    saved = (cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32)
    try:
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = False, True, False
        with _cudnn_benchmark(True):
            assert (cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32) == (True, True, False)
        assert (cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32) == (False, True, False)
    finally:
        cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32 = saved


def test_an_empty_batch_is_named_before_the_vae_runs():
    from qwen21_nodes.qwen21_core.vae import calls

    with pytest.raises(ValueError, match="at least one of each"):
        calls.decode(object(), torch.zeros(0, 64, 4, 4))
    with pytest.raises(ValueError, match="at least one of each"):
        calls.encode(object(), torch.zeros(0, 64, 64, 3))
