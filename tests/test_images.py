"""Condition-image inputs, the reference resize, output-size derivation and size checks."""

import numpy as np
import pytest
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from qwen21_nodes.qwen21_core.images import (
    calculate_dimensions,
    check_output_size,
    condition_images_from_comfy,
    condition_images_to_rgba,
    derive_output_size,
    prepare_condition_image,
    to_rgba,
)


def _rgba_bytes(height=40, width=56, seed=0):
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    array[:5, :, 3] = 0  # some fully transparent and fully opaque rows
    array[5:10, :, 3] = 255
    return array


def _comfy_image_and_mask(array):
    """What ComfyUI's LoadImage gives for an RGBA file: IMAGE = rgb / 255, MASK = 1 - alpha / 255."""
    image = torch.from_numpy(array[..., :3].astype(np.float32) / 255.0)[None]
    mask = 1.0 - torch.from_numpy(array[..., 3].astype(np.float32) / 255.0)[None]
    return image, mask


@pytest.mark.parametrize("ratio", [1.0, 4 / 3, 3 / 4, 16 / 9, 0.37, 2.5])
@pytest.mark.parametrize("resolution", [64, 512, 1024, 1328])
def test_calculate_dimensions_keeps_area_and_ratio_in_multiples_of_32(ratio, resolution):
    width, height = calculate_dimensions(resolution**2, ratio)
    assert width % 32 == 0 and height % 32 == 0
    # Each side is within half a step (16 px) of the exact side for that area and ratio.
    assert abs(width - (resolution**2 * ratio) ** 0.5) <= 16
    assert abs(height - (resolution**2 / ratio) ** 0.5) <= 16


def test_calculate_dimensions_rejects_degenerate_ratios():
    with pytest.raises(ValueError, match="less extreme aspect ratio or a larger output_resolution"):
        calculate_dimensions(64**2, 100.0)


def test_output_size_follows_the_last_condition_image():
    sizes = [(1000, 1000), (1600, 900)]
    assert derive_output_size(sizes, 1024) == calculate_dimensions(1024**2, 1600 / 900)
    assert derive_output_size(sizes[:1], 1024) == (1024, 1024)
    assert derive_output_size([], 768) == (768, 768)
    assert derive_output_size(sizes, 1024, width=512) == (512, calculate_dimensions(1024**2, 16 / 9)[1])
    assert derive_output_size([], 1024, width=640, height=384) == (640, 384)


def test_output_size_must_be_a_multiple_of_32_and_the_error_names_the_nearest():
    with pytest.raises(ValueError, match="width 1000 is not a positive multiple of 32 .*use 992"):
        derive_output_size([], 1024, width=1000)
    with pytest.raises(ValueError, match="height 1010 is not a positive multiple of 32 .*use 1024"):
        check_output_size(1024, 1010)
    with pytest.raises(ValueError, match="height 0 .*use 32"):
        check_output_size(1024, 0)
    with pytest.raises(ValueError, match="width 1000 .*use 992"):
        derive_output_size([], 1000)  # output_resolution itself becomes the size without images
    with pytest.raises(TypeError, match="width must be an int number of pixels, got float"):
        check_output_size(1024.0, 1024)


def test_comfy_image_and_mask_give_back_the_exact_rgba_bytes():
    array = _rgba_bytes()
    image, mask = _comfy_image_and_mask(array)
    (rgba,) = condition_images_from_comfy(image, mask)
    assert rgba.mode == "RGBA"
    assert np.array_equal(np.asarray(rgba), array)


def test_comfy_batch_broadcasts_one_mask_and_fills_a_one_value_mask_of_another_size():
    array = _rgba_bytes()
    image, mask = _comfy_image_and_mask(array)
    batch = torch.cat([image, image.flip(1)])
    first, second = condition_images_from_comfy(batch, mask)
    assert np.array_equal(np.asarray(first)[..., 3], array[..., 3])
    assert np.array_equal(np.asarray(second)[..., 3], array[..., 3])
    assert np.array_equal(np.asarray(second)[..., :3], array[::-1, :, :3])
    # LoadImage's "no alpha" mask is zeros(64, 64): fully opaque at the image's size; any one-value mask likewise.
    (opaque,) = condition_images_from_comfy(image, torch.zeros(64, 64))
    assert (np.asarray(opaque)[..., 3] == 255).all()
    (half,) = condition_images_from_comfy(image, torch.full((1, 7, 5), 0.5))
    assert (np.asarray(half)[..., 3] == 128).all()


def test_a_mask_of_another_size_is_refused_naming_both_sizes():
    image, mask = _comfy_image_and_mask(_rgba_bytes())  # one image, its mask at its size
    height, width = image.shape[1:3]
    other = torch.nn.functional.interpolate(mask[None], size=(height + 8, width), mode="bilinear")[0]
    size = rf"{width}x{height + 8} pixels but image\[0\] is {width}x{height} \(width x height\)"
    with pytest.raises(ValueError, match=r"the mask of image\[0\] is " + size):
        condition_images_from_comfy(image, other)
    with pytest.raises(ValueError, match=rf"the mask of images\[0\] is {width}x{height + 8} pixels"):
        condition_images_to_rgba([_rgba_bytes()[..., :3]], [other[0]])  # numpy image, [H, W] mask


def test_comfy_mask_errors():
    image, mask = _comfy_image_and_mask(_rgba_bytes())
    with pytest.raises(ValueError, match=r"mask must be a ComfyUI MASK \[B, H, W\] with B = 1 or the image batch 1"):
        condition_images_from_comfy(image, torch.cat([mask, mask, mask]))
    four_channels = torch.cat([image, 1.0 - mask[..., None]], dim=-1)
    (rgba,) = condition_images_from_comfy(four_channels)
    assert np.array_equal(np.asarray(rgba), _rgba_bytes())
    with pytest.raises(ValueError, match="already has an alpha channel and a mask was given too"):
        condition_images_from_comfy(four_channels, mask)
    with pytest.raises(ValueError, match=r"ComfyUI IMAGE \[B, H, W, 3\|4\]"):
        condition_images_from_comfy(torch.zeros(1, 1, 8, 8, 3))


def test_other_input_formats_convert_to_rgba():
    array = _rgba_bytes()
    assert np.array_equal(np.asarray(to_rgba(Image.fromarray(array, "RGBA"))), array)
    assert np.array_equal(np.asarray(to_rgba(array)), array)
    assert np.array_equal(np.asarray(to_rgba(array.astype(np.float32) / 255.0)), array)
    rgb = to_rgba(array[..., :3])
    assert (np.asarray(rgb)[..., 3] == 255).all()
    gray = to_rgba(array[..., 0])
    assert np.array_equal(np.asarray(gray)[..., 1], array[..., 0])
    masked = to_rgba(Image.fromarray(array[..., :3]), mask=1.0 - array[..., 3] / 255.0)
    assert np.array_equal(np.asarray(masked), array)


def test_wrong_input_types_and_shapes_get_clear_errors():
    with pytest.raises(
        TypeError, match=r"images\[0\] must be a ComfyUI IMAGE tensor, a PIL image or a numpy array, got str"
    ):
        condition_images_to_rgba(["cat.png"])
    with pytest.raises(TypeError, match=r"images\[0\] is a list; pass one flat sequence"):
        condition_images_to_rgba([[Image.new("RGB", (8, 8))]])
    with pytest.raises(ValueError, match=r"must be \[H, W\], \[H, W, 3\] or \[H, W, 4\]"):
        to_rgba(np.zeros((8, 8, 2), dtype=np.uint8))
    with pytest.raises(TypeError, match="uint8 .* or float .* values, got dtype int64"):
        to_rgba(np.zeros((8, 8, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="one entry .* per image input: got 1 for 2 images"):
        condition_images_to_rgba([Image.new("RGB", (8, 8))] * 2, masks=[None])


def test_flat_sequences_and_batches_expand_in_slot_order():
    array = _rgba_bytes()
    image, mask = _comfy_image_and_mask(array)
    pil = Image.fromarray(array[..., :3])
    images = condition_images_to_rgba([torch.cat([image, image]), pil], masks=[mask, None])
    assert len(images) == 3
    assert np.array_equal(np.asarray(images[1]), array)
    assert (np.asarray(images[2])[..., 3] == 255).all()
    assert condition_images_to_rgba(None) == [] and condition_images_to_rgba(()) == []


@pytest.mark.parametrize("source", [(56, 40), (40, 90), (300, 200)])
def test_prepared_copies_match_the_reference_image_processor(source):
    width, height = source
    rgba = Image.fromarray(_rgba_bytes(height, width), "RGBA")
    prepared = prepare_condition_image(rgba, 64)
    assert (prepared.width, prepared.height) == calculate_dimensions(64**2, width / height)
    assert prepared.source_size == (width, height)
    assert prepared.pad_tokens == (prepared.width // 32) * (prepared.height // 32)

    reference = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=64)
    expected_vae = reference.preprocess(rgba, width=prepared.width, height=prepared.height)  # [1, 4, H, W] in -1..1
    assert prepared.vae.shape == (1, prepared.height, prepared.width, 4)
    assert torch.equal(2.0 * prepared.vae.permute(0, 3, 1, 2) - 1.0, expected_vae)

    resized = np.asarray(reference.resize(rgba, width=prepared.width, height=prepared.height))
    vlm = np.asarray(prepared.vlm)
    assert prepared.vlm.mode == "RGB" and vlm.shape == (prepared.height, prepared.width, 3)
    opaque, clear = resized[..., 3] == 255, resized[..., 3] == 0
    assert np.array_equal(vlm[opaque], resized[..., :3][opaque])  # alpha composited over white
    assert (vlm[clear] == 255).all()


def test_prepare_needs_rgba():
    with pytest.raises(ValueError, match="needs an RGBA image, got mode RGB; use to_rgba first"):
        prepare_condition_image(Image.new("RGB", (64, 64)), 64)
