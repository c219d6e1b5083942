"""The runner's stand-ins for ComfyUI's LoadImage / SaveImage / PreviewImage / alpha nodes keep
ComfyUI's conventions: IMAGE [B,H,W,C] in 0..1, MASK = 1 - alpha, ComfyUI file naming."""

import numpy as np
import pytest
import torch
from PIL import Image
from qwen21_nodes.runner.core_nodes import make_core_nodes


@pytest.fixture
def nodes(tmp_path):
    for name in ("input", "output", "temp"):
        (tmp_path / name).mkdir()
    return make_core_nodes(str(tmp_path / "input"), str(tmp_path / "output"), str(tmp_path / "temp"))


def test_load_image_gives_rgb_and_inverted_alpha(nodes, tmp_path):
    rgba = np.zeros((5, 7, 4), dtype=np.uint8)
    rgba[..., 0] = 255
    rgba[:, :3, 3] = 255  # left part opaque, rest transparent
    Image.fromarray(rgba, "RGBA").save(tmp_path / "input" / "a.png")
    Image.fromarray(rgba[..., :3], "RGB").save(tmp_path / "input" / "b.png")
    (tmp_path / "input" / "notes.txt").write_text("not an image")

    assert nodes["LoadImage"].INPUT_TYPES()["required"]["image"][0] == ["a.png", "b.png"]
    image, mask = nodes["LoadImage"]().load_image("a.png")
    assert image.shape == (1, 5, 7, 3) and image.dtype == torch.float32
    assert torch.all(image[..., 0] == 1.0) and torch.all(image[..., 1:] == 0.0)
    assert mask.shape == (1, 5, 7)
    assert torch.all(mask[:, :, :3] == 0.0) and torch.all(mask[:, :, 3:] == 1.0)
    _, no_alpha = nodes["LoadImage"]().load_image("b.png")
    assert no_alpha.shape == (1, 64, 64) and torch.all(no_alpha == 0)  # ComfyUI's placeholder


def test_save_image_writes_rgb_or_rgba_with_increasing_counter(nodes, tmp_path):
    rgb = torch.rand(2, 4, 6, 3)
    first = nodes["SaveImage"]().save_images(rgb, "run/pic")["ui"]["images"]
    second = nodes["SaveImage"]().save_images(torch.rand(1, 4, 6, 4), "run/pic")["ui"]["images"]
    assert [i["filename"] for i in first + second] == ["pic_00001_.png", "pic_00002_.png", "pic_00003_.png"]
    assert all(i["subfolder"] == "run" and i["type"] == "output" for i in first + second)
    with Image.open(tmp_path / "output" / "run" / "pic_00001_.png") as saved:
        assert saved.mode == "RGB" and saved.size == (6, 4)
        assert (
            np.abs(np.asarray(saved) / 255.0 - rgb[0].numpy()).max() <= 1 / 255 + 1e-6
        )  # truncated to 8 bits, as ComfyUI does
    with Image.open(tmp_path / "output" / "run" / "pic_00003_.png") as saved:
        assert saved.mode == "RGBA"


def test_preview_goes_to_temp_and_prefix_cannot_escape(nodes, tmp_path):
    shown = nodes["PreviewImage"]().save_images(torch.rand(1, 2, 2, 3))["ui"]["images"]
    assert shown[0]["type"] == "temp" and (tmp_path / "temp" / shown[0]["filename"]).is_file()
    with pytest.raises(ValueError, match="outside the output folder"):
        nodes["SaveImage"]().save_images(torch.rand(1, 2, 2, 3), "../escape")


def test_split_and_join_alpha_round_trip(nodes):
    rgba = torch.rand(2, 8, 8, 4)
    rgb, mask = nodes["SplitImageWithAlpha"]().split(rgba)
    assert torch.equal(mask, 1.0 - rgba[..., 3])
    (joined,) = nodes["JoinImageWithAlpha"]().join(rgb, mask)
    assert joined.shape == rgba.shape
    assert torch.allclose(joined, rgba, atol=1e-6)
    _, opaque = nodes["SplitImageWithAlpha"]().split(rgb)
    assert torch.all(opaque == 0)
    (resized,) = nodes["JoinImageWithAlpha"]().join(rgb, torch.zeros(1, 64, 64))
    assert resized.shape == (1, 8, 8, 4) and torch.all(resized[..., 3] == 1)
