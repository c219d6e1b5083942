"""The PNG writer (qwen21_core/png.py) and the Qwen21 Save Image node: valid PNG files with the exact pixels and the
text chunks, however the rows are cut into bands, and the files ComfyUI's Save Image would write (names, pixels,
metadata)."""

import io
import json
import struct
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from qwen21_nodes.nodes import host
from qwen21_nodes.nodes.save import Qwen21SaveImage
from qwen21_nodes.qwen21_core import png
from qwen21_nodes.runner.core_nodes import make_core_nodes


def chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """(type, body) of every chunk, each CRC checked."""
    assert data[:8] == png.PNG_SIGNATURE
    found, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        found.append((kind, body))
        at += 12 + length
    return found


def unfilter_paeth(filtered: np.ndarray, width: int, channels: int) -> np.ndarray:
    """The decoder's side, row by row, as the PNG specification defines it (independent of the vectorised filter)."""
    rows = []
    above = np.zeros(width * channels, np.int32)
    for line in filtered:
        assert line[0] == png.PAETH
        out = np.zeros(width * channels, np.int32)
        for i, value in enumerate(line[1:].astype(np.int32)):
            a = out[i - channels] if i >= channels else 0
            b = above[i]
            c = above[i - channels] if i >= channels else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            predictor = a if pa <= pb and pa <= pc else b if pb <= pc else c
            out[i] = (value + predictor) % 256
        rows.append(out)
        above = out
    return np.stack(rows).astype(np.uint8).reshape(len(rows), width, channels)


@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 7, 4), (9, 5, 1), (6, 11, 2), (37, 23, 3), (64, 64, 4)])
@pytest.mark.parametrize("workers", [1, 3, 8])
def test_png_round_trips_exactly_in_any_number_of_bands(shape, workers, monkeypatch):
    monkeypatch.setattr(png, "MIN_BAND_BYTES", 1)  # bands of a row or more, even for tiny images
    pixels = np.random.default_rng(sum(shape) + workers).integers(0, 256, shape, dtype=np.uint8)
    data = png.encode_png(pixels, {"prompt": '{"1": {"class_type": "X"}}', "workflow": "Grüße ✓"}, workers=workers)
    parts = chunks(data)
    kinds = [kind for kind, _ in parts]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and kinds.index(b"tEXt") < kinds.index(b"IDAT")
    assert b"iTXt" in kinds  # the text that is not Latin-1
    stream = b"".join(body for kind, body in parts if kind == b"IDAT")
    filtered = zlib.decompress(stream)  # checks the combined Adler-32 too
    height, width, channels = shape
    assert len(filtered) == height * (1 + width * channels)
    lines = np.frombuffer(filtered, np.uint8).reshape(height, -1)
    assert np.array_equal(unfilter_paeth(lines, width, channels), pixels)
    with Image.open(io.BytesIO(data)) as picture:
        decoded = np.asarray(picture).reshape(shape)
        assert np.array_equal(decoded, pixels)
        assert picture.text == {"prompt": '{"1": {"class_type": "X"}}', "workflow": "Grüße ✓"}


def test_a_large_image_is_cut_into_bands_and_matches_one_band():
    pixels = np.random.default_rng(0).integers(0, 256, (700, 300, 3), dtype=np.uint8)  # 630 KB: 4 bands
    banded, whole = png.encode_png(pixels, workers=4), png.encode_png(pixels, workers=1)
    assert banded != whole  # the bands' sync flushes are in the stream
    for data in (banded, whole):
        with Image.open(io.BytesIO(data)) as picture:
            assert np.array_equal(np.asarray(picture), pixels)


def test_adler32_of_a_concatenation_from_its_parts():
    rng = np.random.default_rng(1)
    for first_length, second_length in [(0, 0), (0, 5), (5, 0), (1, 1), (70_000, 200_000), (3, 1_000_003)]:
        first = rng.integers(0, 256, first_length, dtype=np.uint8).tobytes()
        second = rng.integers(0, 256, second_length, dtype=np.uint8).tobytes()
        combined = png.adler32_concat(zlib.adler32(first), zlib.adler32(second), len(second))
        assert combined == zlib.adler32(first + second)


@pytest.mark.parametrize("level", [0, 1, 9])
def test_every_compression_level_is_valid(level):
    pixels = np.random.default_rng(level).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    with Image.open(io.BytesIO(png.encode_png(pixels, level=level))) as picture:
        assert np.array_equal(np.asarray(picture), pixels)


@pytest.mark.parametrize(
    ("pixels", "message"),
    [
        (np.zeros((4, 4, 3), np.float32), "uint8"),
        (np.zeros((4, 4, 5), np.uint8), "C in 1-4"),
        (np.zeros((4, 4), np.uint8), "[H, W, C]"),
        (np.zeros((0, 4, 3), np.uint8), "at least one row"),
    ],
)
def test_bad_pixels_are_refused_with_what_was_expected(pixels, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        png.encode_png(pixels)


def test_bad_level_and_keyword_are_refused():
    pixels = np.zeros((2, 2, 3), np.uint8)
    with pytest.raises(ValueError, match="level must be 0 to 9"):
        png.encode_png(pixels, level=10)
    with pytest.raises(ValueError, match="keyword"):
        png.encode_png(pixels, {"": "x"})


@pytest.fixture
def output_dir(tmp_path):
    host.set_output_dir(tmp_path)
    yield tmp_path
    host.set_output_dir("output")


def test_save_node_writes_comfyuis_pixels_names_and_metadata(output_dir):
    images = torch.rand(2, 24, 40, 3) * 1.2 - 0.1  # values past 0 and 1 are clipped, as ComfyUI's SaveImage does
    images[0, 0, 0, 0] = float("nan")
    prompt = {"5": {"class_type": "Qwen21SaveImage", "inputs": {"filename_prefix": "run/pic"}}}
    extra = {"workflow": {"nodes": [{"id": 5, "type": "Qwen21SaveImage"}], "links": []}}
    ui = Qwen21SaveImage().save_images(images, "run/pic", prompt=prompt, extra_pnginfo=extra)["ui"]["images"]
    assert ui == [{"filename": f"pic_{n:05}_.png", "subfolder": "run", "type": "output"} for n in (1, 2)]
    for entry, image in zip(ui, images, strict=True):
        values = np.nan_to_num(255.0 * image.numpy(), nan=0.0)  # NaN as 0; else ComfyUI's SaveImage's formula
        expected = np.clip(values, 0, 255).astype(np.uint8)
        with Image.open(output_dir / "run" / entry["filename"]) as picture:
            assert picture.mode == "RGB"
            assert np.array_equal(np.asarray(picture), expected)
            assert json.loads(picture.text["prompt"]) == prompt
            assert json.loads(picture.text["workflow"]) == extra["workflow"]


def test_save_node_continues_comfyuis_numbering_and_saves_rgba(output_dir):
    stand_in = make_core_nodes(str(output_dir), str(output_dir), str(output_dir / "temp"))["SaveImage"]
    first = stand_in().save_images(torch.rand(1, 8, 8, 3), "pic")["ui"]["images"]
    second = Qwen21SaveImage().save_images(torch.rand(1, 8, 8, 4), "pic")["ui"]["images"]
    assert [e["filename"] for e in first + second] == ["pic_00001_.png", "pic_00002_.png"]
    with Image.open(output_dir / "pic_00002_.png") as picture:
        assert picture.mode == "RGBA" and not picture.text  # no prompt given: no metadata
    batch = Qwen21SaveImage().save_images(torch.rand(2, 8, 8, 3), "b%batch_num%")["ui"]["images"]
    assert [e["filename"] for e in batch] == ["b0_00001_.png", "b1_00002_.png"]


@pytest.mark.parametrize(
    ("images", "message"),
    [
        (torch.rand(8, 8, 3), r"IMAGE \[B, H, W, 3 or 4\], got \(8, 8, 3\)"),
        (torch.rand(1, 8, 8, 5), r"got \(1, 8, 8, 5\)"),
        (torch.rand(0, 8, 8, 3), "images is empty"),
        ("not an image", "got str"),
    ],
)
def test_save_node_refuses_what_is_not_an_image(images, message, output_dir):
    with pytest.raises(ValueError, match=message):
        Qwen21SaveImage().save_images(images, "pic")
    assert not list(output_dir.iterdir())


def test_save_node_fills_in_the_prefix_variables_as_comfyui_does(output_dir):
    (entry,) = Qwen21SaveImage().save_images(torch.rand(1, 32, 64, 3), "%year%/pic_%width%x%height%")["ui"]["images"]
    assert entry["subfolder"] == str(time.localtime().tm_year) and entry["filename"] == "pic_64x32_00001_.png"
    assert (output_dir / entry["subfolder"] / entry["filename"]).is_file()


def test_save_node_refuses_a_prefix_outside_the_output_folder(output_dir):
    with pytest.raises(ValueError, match="outside the output folder"):
        Qwen21SaveImage().save_images(torch.rand(1, 4, 4, 3), "../escape")
