"""Launch the CUDA kernels an image prompt's encode needs before the first edit does.

On a fresh machine the first edit's encode took many times as long as the second, and nearly all of the difference
went to one op: `image_grid_thw.prod(-1)` in transformers' Qwen3-VL, the first launch of an int64 reduction kernel. A
second process on the same machine did not pay it, even with a new driver cache (CUDA_CACHE_PATH): the cost is the
machine's first use of that kernel's code. With this job the first edit's encode is as quick as the second
(bench_edit_encode.py measures both).

The job here runs the same code on a tiny model of the same classes: a 2-layer Qwen3-VL, one prompt, one small
image. The kernels load (or compile) once per process, so it does not matter which model launches them. The model is
built on the meta device and then given uninitialised memory. The values do not matter, only which kernels launch,
and the process's random state stays untouched. Two things are shared with the main thread, so the job stays off
them:
- The tokenizer: a fast tokenizer used from two threads at once can fail with "Already borrowed". So the job's
  inputs are made when the job is made, on the caller's thread.
- SDPA's backend flags are global, not per thread: entering `planless_kernels` here (as the encoder does) could
  change the kernel that a decode step on the main thread picks, and SDPA outside it would plan cuDNN attention the
  encoder never runs. So the tiny model uses transformers' eager attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from PIL import Image

from .encoder import ENCODE_INPUTS, Qwen21TextEncoder, build_prompt_text

log = logging.getLogger(__name__)

WARMUP_IMAGE_SIZE = 64  # the processor scales it up to its minimum pixel count (256^2 for Qwen3-VL): 64 image tokens


def image_encode_warmup_jobs(encoder: Qwen21TextEncoder | None, device: torch.device) -> list[Callable[[], None]]:
    """One job that runs an image prompt through a tiny Qwen3-VL on `device`. There are no jobs without an encoder
    or off CUDA. Everything that reads the tokenizer (the inputs, the tiny model's config) runs now, on the caller's
    thread."""
    if encoder is None or device.type != "cuda":
        return []
    try:
        image = Image.new("RGB", (WARMUP_IMAGE_SIZE, WARMUP_IMAGE_SIZE), (128, 128, 128))
        config, inputs = tiny_encode_inputs(encoder.processor, [image])
        dtype = encoder.dtype
    except Exception as error:  # noqa: BLE001 - a warm-up never fails a load
        log.warning("no image-encode warm-up (%s: %s); the first edit loads its kernels itself",
                    type(error).__name__, error)  # fmt: skip
        return []
    return [lambda: run_tiny_encode(config, inputs, device, dtype)]


def text_prompt_priming() -> Callable[[torch.device, torch.dtype], None]:
    """The step of qwen21_core/startup/priming.py that runs a text-only prompt through a tiny Qwen3-VL, so the language
    model's torch kernels load before any encoder exists. Its tiny processor, inputs and config are made now, on the
    caller's thread: every import happens there and not in the priming thread, where an import racing one of the main
    thread's could deadlock Python's import locks."""
    from transformers import Qwen3VLModel  # noqa: F401 - the one run_tiny_encode imports, imported here first

    from .tiny import build_tiny_processor

    config, inputs = tiny_encode_inputs(build_tiny_processor(), [])
    return lambda device, dtype: run_tiny_encode(config, inputs, device, dtype)


def tiny_encode_inputs(processor, images: list) -> tuple[object, dict]:
    """(a 2-layer Qwen3-VL config for `processor`'s tokenizer, the model inputs of a warm-up prompt with `images`).
    Both read the tokenizer: make them on the thread that owns it."""
    from .tiny import tiny_text_encoder_config

    inputs = processor(text=[build_prompt_text("a warm-up", len(images))], images=images or None, return_tensors="pt")
    inputs = {name: inputs[name] for name in ENCODE_INPUTS if name in inputs}
    return tiny_text_encoder_config(processor.tokenizer), inputs


def run_tiny_encode(config, inputs: dict, device: torch.device, dtype: torch.dtype) -> None:
    """A Qwen3-VL of `config` (no weights set: meta, then uninitialised memory on `device`) runs `inputs` (a prompt,
    with or without images) once."""
    from transformers import Qwen3VLModel

    # no dtype= here: transformers would set the process's default dtype for it, from this background thread
    with torch.device("meta"):
        model = Qwen3VLModel._from_config(config, attn_implementation="eager")
    model = model.to(dtype).to_empty(device=device).eval()
    with torch.no_grad():
        model(**{name: tensor.to(device) for name, tensor in inputs.items()}, use_cache=False)
