"""Saving a generated image: ComfyUI's Save Image (PIL, one core) against Qwen21 Save Image (bands on every core).

    python benchmarks/bench_save_png.py                 # 1024^2 and 1536^2, RGB and RGBA; one JSON line each
    python benchmarks/bench_save_png.py --sizes 64 --rounds 1

Both run through node classes on the same IMAGE tensor, alternating, in one process: ComfyUI's is the runner's
stand-in (the same PIL call as ComfyUI's SaveImage: compression level 4, the prompt as metadata), ours the pack's
node. Images: `noise`, what random weights decode to (the session benchmark's images: next to incompressible), and
`textured`, smooth gradients with fine grain, which compresses as a photograph does (no photograph can be
downloaded here). A line: the median seconds of each, their ratio, both file sizes and whether both files decode to
the same pixels.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from _common import emit
from PIL import Image
from qwen21_nodes.nodes import host
from qwen21_nodes.nodes.save import Qwen21SaveImage
from qwen21_nodes.qwen21_core.png import usable_cores
from qwen21_nodes.runner.core_nodes import make_core_nodes

PROMPT = {"5": {"class_type": "Qwen21SaveImage", "inputs": {"filename_prefix": "bench"}}}


def image(kind: str, size: int, channels: int) -> torch.Tensor:
    rng = np.random.default_rng(size + channels)
    if kind == "noise":
        pixels = rng.random((size, size, channels), dtype=np.float32)
    else:
        y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
        base = np.stack([x, y, 0.5 + 0.5 * np.sin(6 * x + 4 * y), 1 - x * y][:channels], axis=-1)
        pixels = np.clip(base + rng.normal(0, 0.025, base.shape).astype(np.float32), 0, 1)
    return torch.from_numpy(pixels)[None]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1024,1536")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="qwen21_save_png_"))
    host.set_output_dir(folder)
    comfyui = make_core_nodes(str(folder), str(folder), str(folder / "temp"))["SaveImage"]()
    ours = Qwen21SaveImage()
    savers = {"comfyui": lambda im: comfyui.save_images(im, "comfyui", prompt=PROMPT),
              "ours": lambda im: ours.save_images(im, "ours", prompt=PROMPT)}  # fmt: skip
    for size in [int(s) for s in args.sizes.split(",")]:
        for kind in ("noise", "textured"):
            for channels in (3, 4):
                images = image(kind, size, channels)
                times = {name: [] for name in savers}
                files = {}
                for _ in range(args.rounds + 1):  # the first round warms both up and is not counted
                    for name, save in savers.items():
                        start = time.perf_counter()
                        entry = save(images)["ui"]["images"][0]
                        times[name].append(time.perf_counter() - start)
                        files[name] = folder / entry["subfolder"] / entry["filename"]
                median = {name: statistics.median(values[1:] or values) for name, values in times.items()}
                with Image.open(files["comfyui"]) as a, Image.open(files["ours"]) as b:
                    same_pixels = a.mode == b.mode and np.array_equal(np.asarray(a), np.asarray(b))
                emit(what="save_png", image=kind, size=size, channels=channels, cores=usable_cores(),
                     rounds=args.rounds, comfyui_s=round(median["comfyui"], 4), ours_s=round(median["ours"], 4),
                     ratio=round(median["ours"] / median["comfyui"], 3),
                     comfyui_kib=files["comfyui"].stat().st_size // 1024, ours_kib=files["ours"].stat().st_size // 1024,
                     same_pixels=same_pixels)  # fmt: skip


if __name__ == "__main__":
    main()
