"""VAE tiling: tile grid, blending (exactness on a local function, no seam), tiled vs untiled on the tiny VAE,
the memory plan, injected out-of-memory (halving sequence, unchanged configuration, error at the floor),
and the progress / interrupt callback.

Stated bounds (tiny VAE, 128 px tiles = 8 latents with 2-latent overlap, attention neutralised so that
the model is local): decode PSNR >= 30 dB and max |diff| <= 0.35 against untiled (observed 32.7 dB, 0.24);
no seam: in every pixel column and row, the mean absolute gradient of the tiled image is within 1.3x that of
the untiled one (a hard cut between tiles measures 2.4x); encode max |diff| <= 0.7 (observed 0.48, latents
up to 1.8).
"""

from __future__ import annotations

import pytest
import torch
from qwen21_nodes.qwen21_core.vae import tiling as vae_tiling
from qwen21_nodes.qwen21_core.vae.tiling import TilingConfig, VAEOutOfMemoryError, tile_starts
from vae_reference import TINY_VAE, our_vae, psnr


@pytest.fixture(scope="module")
def local_vae():
    """The tiny VAE with both attention blocks adding zero: every output depends on a finite neighbourhood."""
    vae = our_vae(TINY_VAE, seed=3)
    with torch.no_grad():
        for block in (vae.decoder.mid_block.attentions[0], vae.encoder.mid_block.attentions[0]):
            block.proj.weight.zero_()
            block.proj.bias.zero_()
    return vae


@pytest.fixture
def vae():
    return our_vae(TINY_VAE, seed=4)


def _latents(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------
# Grid and blending
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length,tile,overlap", [(8, 8, 2), (9, 8, 2), (20, 8, 2), (57, 32, 8), (100, 6, 3)])
def test_tile_starts_cover_evenly_with_the_minimum_overlap(length, tile, overlap):
    starts = tile_starts(length, tile, overlap)
    assert starts[0] == 0 and starts == sorted(set(starts))
    assert min(starts[-1] + tile, length) == length if length > tile else starts == [0]
    assert all(start + tile <= max(length, tile) for start in starts)
    assert all(b - a <= tile - overlap for a, b in zip(starts, starts[1:], strict=False))
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert not gaps or max(gaps) - min(gaps) <= 1  # evenly spread


def _decode_like(z):
    """A purely local 'decoder': 16x nearest upsampling of a per-pixel channel mix."""
    mixed = torch.stack([z[:, 0] + z[:, 1], z[:, 2] * 0.5, z[:, 3] - z[:, 0], z[:, 1]], dim=1)
    return mixed.repeat_interleave(16, 2).repeat_interleave(16, 3)


def _encode_like(x):
    return torch.nn.functional.avg_pool2d(x, 16)


@pytest.mark.parametrize("tile_size", [32, 48, 64, 160])
def test_tiling_reproduces_a_local_function_exactly(tile_size):
    z = _latents(2, 4, 7, 11)
    config = TilingConfig(tile_size=tile_size)
    out, info = vae_tiling.run(
        _decode_like, z, kind="decode", mode="on", tile_size=None, config=config, quality="exact"
    )
    assert info["tiled"] and info["tile_size"] == tile_size
    assert torch.allclose(out, _decode_like(z), atol=1e-6, rtol=0)

    x = _latents(1, 4, 112, 176, seed=1)
    enc, info = vae_tiling.run(
        _encode_like, x, kind="encode", mode="on", tile_size=None, config=config, quality="exact"
    )
    assert info["tiled"] and torch.allclose(enc, _encode_like(x), atol=1e-6, rtol=0)


def test_blend_region_crossfades_linearly_between_neighbouring_tiles():
    """Each tile paints one constant (its index); across an overlap the output must ramp linearly from one
    constant to the next (no step = no seam), and stay exactly constant outside overlaps."""
    calls = []

    def paint(z):
        calls.append(len(calls))
        return torch.full((1, 1, z.shape[2] * 16, z.shape[3] * 16), float(len(calls) - 1))

    z = torch.zeros(1, 4, 1, 20)  # one row of tiles: 8-latent tiles, starts 0, 6, 12
    out, info = vae_tiling.run(
        paint, z, kind="decode", mode="on", tile_size=128, config=TilingConfig(), quality="exact"
    )
    row = out[0, 0, 0]
    assert info["tiles"] == 3 and tile_starts(20, 8, 2) == [0, 6, 12]
    assert torch.equal(row[: 6 * 16], torch.zeros(96))  # tile 0 alone
    assert torch.equal(row[8 * 16 : 12 * 16], torch.ones(64))  # tile 1 alone
    assert torch.equal(row[14 * 16 :], torch.full((96,), 2.0))  # tile 2 alone
    for lo, hi, a in ((6 * 16, 8 * 16, 0.0), (12 * 16, 14 * 16, 1.0)):  # 32-pixel overlaps
        ramp = row[lo:hi]
        assert torch.all(ramp[1:] > ramp[:-1])  # strictly increasing across the overlap
        assert torch.allclose(ramp, a + (torch.arange(32) + 0.5) / 32, atol=1e-6)
    assert (row[1:] - row[:-1]).abs().max() <= 1 / 32 + 1e-6  # never a step larger than one ramp increment


@pytest.mark.parametrize(
    "height,width,tile_size,tiles",
    [(12, 20, 128, 6), (11, 7, 96, 6)],
    ids=["even", "odd"],
)
def test_tiled_decode_is_close_to_untiled_without_seams(local_vae, height, width, tile_size, tiles):
    """Odd sizes too (latents not a multiple of the tile stride): the last tile is placed flush with the edge and
    overlaps its neighbour by more than the minimum; the stated bounds hold there as well."""
    z = _latents(1, 4, height, width, seed=2)
    full = local_vae.decode(z, tiling="off")
    tiled = local_vae.decode(z, tiling="on", tile_size=tile_size)
    info = local_vae.last_decode_info
    assert info["tiled"] and info["tiles"] == tiles and info["tile_size"] == tile_size
    assert tiled.shape == full.shape == (1, 16 * height, 16 * width, 4)
    assert psnr(tiled, full) >= 30 and (tiled - full).abs().max() <= 0.35
    assert not torch.equal(tiled, full)  # it really decoded tiles

    for axis in (1, 2):  # columns, rows: the tiled image's gradient never jumps at a seam
        grad = (tiled.diff(dim=axis)).abs().mean(dim=(0, 3, 3 - axis))
        grad_full = (full.diff(dim=axis)).abs().mean(dim=(0, 3, 3 - axis))
        assert (grad / grad_full).max() <= 1.3


def test_tiled_encode_is_close_to_untiled(local_vae):
    images = torch.rand(1, 192, 320, 4, generator=torch.Generator().manual_seed(3))
    full = local_vae.encode(images, tiling="off")
    tiled = local_vae.encode(images, tiling="on", tile_size=128)
    assert local_vae.last_encode_info["tiled"] and tiled.shape == full.shape and tiled.dtype == full.dtype
    assert (tiled - full).abs().max() <= 0.7


def test_tile_size_is_validated(vae):
    with pytest.raises(ValueError, match=r"multiple of 16 pixels, got 100; e.g. 96"):
        vae.decode(_latents(1, 4, 2, 2), tiling="on", tile_size=100)
    with pytest.raises(ValueError, match="overlap"):
        TilingConfig(overlap=0.75)


# ---------------------------------------------------------------------------------------------------------
# Memory plan ("auto")
# ---------------------------------------------------------------------------------------------------------


def test_auto_tiles_on_the_cpu_past_what_a_host_pass_may_take(vae, monkeypatch):
    """A 4096 px decode on the CPU grew the process by 11 GB untiled; "auto" now plans with the RAM a pass may
    take (the available RAM, at most HOST_PASS_BYTES) and tiles past it."""
    gib = 2**30
    monkeypatch.setattr(vae_tiling, "host_free_bytes", lambda: 64 * gib)
    assert vae_tiling.available_bytes(torch.device("cpu")) == int(vae_tiling.HOST_PASS_BYTES * vae_tiling.SAFETY)
    monkeypatch.setattr(vae_tiling, "host_free_bytes", lambda: gib)
    assert vae_tiling.available_bytes(torch.device("cpu")) == int(gib * vae_tiling.SAFETY)
    monkeypatch.setattr(vae_tiling, "host_free_bytes", lambda: None)  # unreadable: the cap alone
    assert vae_tiling.available_bytes(torch.device("cpu")) == int(vae_tiling.HOST_PASS_BYTES * vae_tiling.SAFETY)

    vae.decode(_latents(1, 4, 12, 12), tiling="auto")
    assert vae.last_decode_info["tiled"] is False  # small: untiled
    per_image = vae_tiling.bytes_per_pixel("decode", "exact", torch.float32) * vae.activation_scale("decode")
    monkeypatch.setattr(vae_tiling, "HOST_PASS_BYTES", int(per_image * 192 * 192 / 4 * 1.01 / vae_tiling.SAFETY))
    vae.tiling_config = TilingConfig(min_tile_size=32)
    vae.decode(_latents(1, 4, 12, 12), tiling="auto")
    info = vae.last_decode_info
    assert info["tiled"] is True and info["tile_size"] == 96  # a quarter of the pixels: half the side


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", ["tiny", "full"])
def test_the_plan_covers_what_a_pass_holds_at_every_model_width(size, dtype):
    """The per-pixel estimate, scaled by the model's width, is at least the peak of live tensors of a real pass
    (on the meta device, so the full-size model costs nothing) and at most twice it: without the width scale the
    tiny VAE's estimate was 17x too large, so the CPU would have tiled decodes that fit."""
    from qwen21_nodes.qwen21_core.config import VAEConfig
    from qwen21_nodes.qwen21_core.tiny import TINY_VAE as PACK_TINY_VAE
    from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE

    config = PACK_TINY_VAE if size == "tiny" else VAEConfig()
    with torch.device("meta"):
        model = QwenImage21VAE(config).eval().to(dtype)
    z = torch.empty(1, config.z_dim, 16, 16, device="meta", dtype=dtype)
    x = torch.empty(1, 4, 256, 256, device="meta", dtype=dtype)
    for kind, run in (("decode", lambda: model.decode_pixels(z)), ("encode", lambda: model.encode_pixels(x))):
        held = vae_tiling.live_tensor_peak(run) / 256**2
        estimate = vae_tiling.bytes_per_pixel(kind, "exact", dtype) * model.activation_scale(kind)
        assert held <= estimate <= 2 * held, (kind, held, estimate)


def test_one_call_is_capped_in_size_before_anything_is_allocated(vae):
    from qwen21_nodes.qwen21_core.vae.model import MAX_CALL_PIXELS, MAX_IMAGE_SIDE

    side = MAX_IMAGE_SIDE // 16 + 1
    huge = torch.zeros(1, 4, 1, 1).expand(1, 4, side, side)  # no memory behind it
    with pytest.raises(
        ValueError, match=rf"VAE decode: latents of {side * 16}x{side * 16} px.*at most {MAX_IMAGE_SIDE}"
    ):
        vae.decode(huge)
    batch = MAX_CALL_PIXELS // (512 * 512) + 1
    many = torch.zeros(1, 4, 1, 1).expand(batch, 4, 32, 32)
    with pytest.raises(ValueError, match=rf"{batch} images at 512x512 px.*{batch - 1} images of this size"):
        vae.decode(many)
    pixels = torch.zeros(1, 1, 1, 3).expand(1, MAX_IMAGE_SIDE + 16, 16, 3)
    with pytest.raises(ValueError, match=r"VAE encode: images of 16x8208 px"):
        vae.encode(pixels)


def test_available_memory_honours_a_per_process_cap(fake_cuda_memory):
    """The decode plans with the planner's free memory: under a 16 GB cap on an 80 GB card with 60 GB free it
    plans with what the cap leaves, not with the 60 GB (it went untiled, ran out of memory and only then tiled)."""
    gib = 2**30
    fake_cuda_memory(free=60 * gib, total=80 * gib, reserved=15 * gib, allocated=14 * gib, fraction=0.2)
    assert vae_tiling.available_bytes(torch.device("cuda", 0)) == int(2 * gib * vae_tiling.SAFETY)  # 16 - 14 GiB


def _pretend_free_bytes(monkeypatch, free):
    monkeypatch.setattr(vae_tiling, "available_bytes", lambda device: free)


def test_auto_splits_the_batch_then_tiles_as_memory_shrinks(vae, monkeypatch):
    vae.tiling_config = TilingConfig(min_tile_size=32)
    z = _latents(3, 4, 6, 6, seed=4)
    per_image = vae_tiling.bytes_per_pixel("decode", "exact", torch.float32) * vae.activation_scale("decode") * 96 * 96

    _pretend_free_bytes(monkeypatch, 3 * per_image)
    whole = vae.decode(z, tiling="auto")
    assert vae.last_decode_info["tiled"] is False and vae.last_decode_info["batch_chunk"] == 3

    _pretend_free_bytes(monkeypatch, 2 * per_image)
    chunked = vae.decode(z, tiling="auto")
    assert vae.last_decode_info["batch_chunk"] == 2 and vae.last_decode_info["tiles"] == 2
    assert torch.allclose(chunked, whole, atol=1e-6)

    _pretend_free_bytes(monkeypatch, per_image // 3)  # fits a tile of 96/sqrt(3) = 55 px -> 3 latents, 48 px
    vae.decode(z[:1], tiling="auto")
    info = vae.last_decode_info
    assert info["tiled"] is True and info["tile_size"] == 48 and info["tiles"] == len(tile_starts(6, 3, 1)) ** 2


# ---------------------------------------------------------------------------------------------------------
# Out of memory
# ---------------------------------------------------------------------------------------------------------


def _oom_above(monkeypatch, latent_limit, seen):
    """Make the first conv of a decode (post_quant_conv, on the latent tile) raise CUDA OOM for tiles larger
    than latent_limit; record the tile sides it saw."""
    real = torch.nn.functional.conv2d

    def conv2d(x, weight, *args, **kwargs):
        if weight.shape[:2] == (TINY_VAE.z_dim, TINY_VAE.z_dim):
            seen.append(x.shape[-1])
            if max(x.shape[-2:]) > latent_limit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (injected)")
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "conv2d", conv2d)


def test_oom_halves_the_tile_keeps_the_overlap_ratio_and_leaves_the_config(vae, monkeypatch):
    vae.tiling_config = config = TilingConfig(tile_size=256, overlap=0.25, min_tile_size=32)
    z = _latents(1, 4, 10, 10, seed=5)
    seen = []
    _oom_above(monkeypatch, 4, seen)
    images = vae.decode(z, tiling="on")
    info = vae.last_decode_info
    assert info["oom_retries"] == 2 and info["tile_size"] == 64 and info["tiled"]
    assert seen[:2] == [10, 8] and set(seen[2:]) == {4}  # 256 px (whole image), 128 px failed; 64 px tiles
    assert info["tiles"] == len(tile_starts(10, 4, 1)) ** 2  # overlap still 25% (1 of 4 latents)
    assert vae.tiling_config is config and config == TilingConfig(tile_size=256, overlap=0.25, min_tile_size=32)
    assert images.shape == (1, 160, 160, 4) and torch.isfinite(images).all()


def test_oom_at_the_floor_raises_a_clear_error(vae, monkeypatch):
    vae.tiling_config = config = TilingConfig(tile_size=256, min_tile_size=64)
    seen = []
    _oom_above(monkeypatch, 0, seen)  # everything fails
    with pytest.raises(VAEOutOfMemoryError, match=r"even with 64px tiles \(tried \[256, 128, 64\] px") as err:
        vae.decode(_latents(1, 4, 16, 16), tiling="on")
    assert isinstance(err.value, torch.OutOfMemoryError)  # ComfyUI's OOM handling still catches it
    assert "Free GPU memory" in str(err.value)
    assert seen == [16, 8, 4] and vae.tiling_config is config


def test_auto_falls_back_to_tiles_when_untiled_runs_out_of_memory(vae, monkeypatch):
    vae.tiling_config = TilingConfig(tile_size=64, min_tile_size=32)
    _pretend_free_bytes(monkeypatch, 1 << 40)  # the plan says: untiled
    seen = []
    _oom_above(monkeypatch, 4, seen)
    vae.decode(_latents(1, 4, 6, 6), tiling="auto")
    info = vae.last_decode_info
    assert seen[0] == 6 and info["tiled"] and info["tile_size"] == 64 and info["oom_retries"] == 1

    with pytest.raises(VAEOutOfMemoryError, match="ran out of GPU memory untiled.*tiling='auto' or 'on'"):
        vae.decode(_latents(1, 4, 6, 6), tiling="off")


# ---------------------------------------------------------------------------------------------------------
# Progress and interrupt
# ---------------------------------------------------------------------------------------------------------


def test_callback_reports_every_tile_and_can_interrupt(vae):
    z = _latents(1, 4, 6, 6, seed=6)
    calls = []
    vae.decode(z, tiling="on", tile_size=64, callback=lambda done, total: calls.append((done, total)))
    assert calls == [(k, 4) for k in range(1, 5)]
    calls.clear()
    vae.decode(z, tiling="off", callback=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 1)]

    class Interrupted(Exception):
        pass

    def stop_at_second(done, total):
        if done == 2:
            raise Interrupted

    before = vae.decode(z, tiling="on", tile_size=64)
    with pytest.raises(Interrupted):
        vae.decode(z, tiling="on", tile_size=64, callback=stop_at_second)
    assert torch.equal(vae.decode(z, tiling="on", tile_size=64), before)  # nothing left behind


def test_the_untiled_request_is_what_the_plan_needs_to_decode_untiled(vae, monkeypatch):
    """untiled_decode_bytes is the free memory at which "auto" stops tiling: what Qwen21Model.decode asks ComfyUI to
    free. One byte less and the same decode tiles, so a request smaller than the plan's need would not help."""
    z = _latents(2, 4, 6, 6, seed=5)
    needed = vae.untiled_decode_bytes(z.shape)
    one = vae.untiled_decode_bytes((1, *z.shape[1:]))
    assert needed == 2 * one > 0
    assert vae.untiled_decode_bytes(z.shape, quality="fast") < needed  # the fast path holds less
    _pretend_free_bytes(monkeypatch, int(needed * vae_tiling.SAFETY) + 1)
    vae.decode(z, tiling="auto")
    assert vae.last_decode_info["tiled"] is False and vae.last_decode_info["batch_chunk"] == 2
    _pretend_free_bytes(monkeypatch, int(one * vae_tiling.SAFETY) - 64)
    vae.tiling_config = TilingConfig(min_tile_size=32)
    vae.decode(z, tiling="auto")
    assert vae.last_decode_info["tiled"] is True
