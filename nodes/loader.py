"""Loader nodes: the three ComfyUI model files, or a diffusers folder -> QWEN21_MODEL."""

from __future__ import annotations

import logging
import os

import torch

from ..qwen21_core.checkpoints.loading import COMFYUI_TOKENIZER_DIR, find_tokenizer
from ..qwen21_core.pipeline import Qwen21Pipeline
from . import host
from .model import MODEL_TYPE, Qwen21Model

log = logging.getLogger(__name__)

CATEGORY = "Qwen21/loaders"
DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}


def _device_choices() -> list[str]:
    return ["auto", "cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def _common_inputs() -> dict:
    return {
        "weight_dtype": (
            list(DTYPES),
            {
                "default": "auto",
                "tooltip": "auto: bf16 on a GPU, fp32 on CPU. bf16: the released precision; the DiT's 7.115 B "
                "parameters take 13.3 GiB, the text encoder peaks at 16.4 GiB (BENCHMARKS: DiT, Text encoder). "
                "fp32: twice the memory (speed not benchmarked); matches the diffusers fp32 reference to rounding.",
            },
        ),
        "device": (
            _device_choices(),
            {
                "default": "auto",
                "tooltip": "auto: ComfyUI's GPU (or the first CUDA GPU outside ComfyUI), else CPU. cpu: for "
                "tests and tiny models; the full-size model on a CPU is not benchmarked and far too slow to use.",
            },
        ),
        "offload_text_encoder": (
            "BOOLEAN",
            {
                "default": True,
                "tooltip": "On: move the text encoder to CPU RAM right after encoding, leaving the VRAM to the "
                "DiT. Each new prompt then moves it back and off again: 12.2 s for that round trip of the 8B "
                "encoder on an H200 host (BENCHMARKS: Text encoder); a true_cfg_scale > 1 run pays it once more, "
                "for the negative prompt, the first time. Off: keep it on the GPU for instant re-encoding "
                "(inside ComfyUI its memory manager still moves it off when another model needs the room).",
            },
        ),
    }


def _load(source, weight_dtype: str, device: str, offload_text_encoder: bool) -> Qwen21Model:
    target = host.torch_device() if device == "auto" else torch.device(device)
    dtype = DTYPES[weight_dtype]
    if dtype is None:
        dtype = torch.float32 if target.type == "cpu" else torch.bfloat16
    log.info("loading Qwen-Image-2.1 from %s (%s on %s)", source, dtype, target)
    pipe = Qwen21Pipeline.from_pretrained(
        source,
        device=target,
        dtype=dtype,
        # Inside ComfyUI the memory manager places the text encoder; Qwen21Model offloads it on request.
        text_encoder_offload=offload_text_encoder and not host.IN_COMFYUI,
    )
    return Qwen21Model(pipe, offload_text_encoder=offload_text_encoder)


def _comfyui_tokenizer(text_encoder_path: str) -> str | None:
    """ComfyUI's bundled Qwen tokenizer, for a text-encoder file with no tokenizer of its own nearby
    (model folders from extra_model_paths.yaml may lie outside the ComfyUI tree)."""
    root = host.comfyui_root()
    if root is None:
        return None
    try:
        find_tokenizer(text_encoder_path)
    except FileNotFoundError:
        return os.path.join(root, COMFYUI_TOKENIZER_DIR)
    return None


class _PipelineLoader:
    """What both loaders declare alike: their category and their one output, the pipeline."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (MODEL_TYPE,)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("The loaded pipeline; connect it to the Qwen21 encode, sampler and VAE nodes.",)
    FUNCTION = "load"


class Qwen21ModelLoader(_PipelineLoader):
    """Load Qwen-Image-2.1 from the three ComfyUI model files (diffusion model, text encoder, VAE)."""

    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "diffusion_model": (
                    host.list_weight_files("diffusion_models"),
                    {"tooltip": "The DiT file from models/diffusion_models (e.g. qwen_image_2.1_bf16.safetensors)."},
                ),
                "text_encoder": (
                    host.list_weight_files("text_encoders"),
                    {"tooltip": "The Qwen3-VL-8B file from models/text_encoders (e.g. qwen3vl_8b_bf16.safetensors)."},
                ),
                "vae": (
                    host.list_weight_files("vae"),
                    {"tooltip": "The RGBA VAE file from models/vae (e.g. qwen_image_2.1_vae_bf16.safetensors)."},
                ),
                **_common_inputs(),
            }
        }

    def load(self, diffusion_model, text_encoder, vae, weight_dtype, device, offload_text_encoder):
        source = {
            "transformer": host.weight_file_path("diffusion_models", diffusion_model),
            "text_encoder": host.weight_file_path("text_encoders", text_encoder),
            "vae": host.weight_file_path("vae", vae),
        }
        tokenizer = _comfyui_tokenizer(source["text_encoder"])
        if tokenizer is not None:
            source["tokenizer"] = tokenizer
        return (_load(source, weight_dtype, device, offload_text_encoder),)


class Qwen21DiffusersLoader(_PipelineLoader):
    """Load Qwen-Image-2.1 from a diffusers folder (model_index.json) in models/diffusers."""

    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "folder": (
                    host.list_diffusers_folders(),
                    {"tooltip": "A Qwen-Image-2.1 diffusers folder (the Hugging Face layout) under models/diffusers."},
                ),
                **_common_inputs(),
            }
        }

    def load(self, folder, weight_dtype, device, offload_text_encoder):
        return (_load(host.diffusers_folder_path(folder), weight_dtype, device, offload_text_encoder),)
