"""Loader nodes: the three ComfyUI model files, or a diffusers folder -> QWEN21_MODEL."""

from __future__ import annotations

import logging
import os

import torch

from ..qwen21_core.checkpoints.loading import COMFYUI_TOKENIZER_DIR, estimated_loaded_bytes, find_tokenizer
from ..qwen21_core.pipeline import Qwen21Pipeline
from ..qwen21_core.quant.plan import WeightFormats
from . import host, memory_adapter
from .model import MODEL_TYPE, Qwen21Model

log = logging.getLogger(__name__)

CATEGORY = "Qwen21/loaders"
# weight_dtype choice -> (compute dtype, weight format of the DiT and text encoder; quant/plan.py)
PRECISIONS = {
    "auto": (None, "auto"),
    "bf16": (torch.bfloat16, "none"),
    "fp8": (torch.bfloat16, "fp8"),
    "int8": (torch.bfloat16, "int8"),
    "int8_convrot": (torch.bfloat16, "int8_convrot"),
    "fp32": (torch.float32, "none"),
}
TEXT_ENCODER_PRECISIONS = ("same", "auto", "bf16", "fp8", "int8", "int8_convrot")


# The tooltips' figures cite BENCHMARKS sections (tests/test_claims.py checks them).
WEIGHT_DTYPE_TOOLTIP = (
    "auto: each file's own format (an fp8 or int8_convrot file runs quantised, a bf16 file in bf16), bf16 compute on "
    "a GPU, fp32 on CPU. bf16: everything in bf16, the DiT 13.25 GiB (BENCHMARKS: Quantised DiT). fp8: FP8 e4m3 "
    "weights and activations "
    "on GPUs with FP8 tensor cores (RTX 40xx, H100 and newer; elsewhere dequantised per layer); int8 / "
    "int8_convrot: INT8 weights and activations (RTX 20xx and newer); int8_convrot (native ComfyUI's int8 files) "
    "rotates first, for less error on real weights. On an H200 at 1024x1024 the quantised DiT takes 6.76 GiB and "
    "a step 0.593x (fp8), 0.696x (int8), 0.727x (int8_convrot) of bf16's time (BENCHMARKS: Quantised DiT). Quantised "
    "files load as they are; bf16 files are quantised while loading. A GGUF DiT: auto keeps its blocks, any other "
    "choice dequantises them while loading. fp32: twice bf16's memory; matches the diffusers fp32 reference to "
    "rounding."
)
TEXT_ENCODER_DTYPE_TOOLTIP = (
    "same: follow weight_dtype. Otherwise the text encoder's own precision; auto keeps its file's format. fp8 / "
    "int8: its language model's Linears stored 8-bit, 8.71 GiB of weights instead of 15.17 GiB on an H200 "
    "(BENCHMARKS: Text encoder), multiplied in bf16 with each weight dequantised as its layer runs (as native "
    "ComfyUI runs fp8 text encoders: quantising the activations too made the embeddings drift)."
)


OFFLOAD_TOOLTIP = (
    "When the text encoder leaves the GPU. auto: it stays after encoding while the GPU has the room, so a changed "
    "prompt does not move it, and leaves only when the diffusion model or another model needs the room; then it "
    "comes back from a copy kept in pinned RAM (as much RAM as its weights). always: off right after every encode "
    "(most room for the diffusion model; every new prompt moves it back). never: it stays (the diffusion model "
    "streams blocks from RAM instead; inside ComfyUI its memory manager can still move it off). Workflows saved with "
    "the older on/off switch keep their meaning: on = always, off = never."
)


def _device_choices() -> list[str]:
    return ["auto", "cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def _common_inputs() -> dict:
    return {
        "weight_dtype": (
            list(PRECISIONS),
            {
                "default": "auto",
                "tooltip": WEIGHT_DTYPE_TOOLTIP,
            },
        ),
        "text_encoder_dtype": (
            list(TEXT_ENCODER_PRECISIONS),
            {
                "default": "same",
                "tooltip": TEXT_ENCODER_DTYPE_TOOLTIP,
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
            list(memory_adapter.TEXT_ENCODER_OFFLOAD),
            {
                "default": "auto",
                "tooltip": OFFLOAD_TOOLTIP,
            },
        ),
    }


# Optional loader inputs, added after the others so saved workflows (positional widget values) keep loading.
def _placement_inputs() -> dict:
    return {
        "text_encoder_device": (
            _device_choices(),
            {
                "default": "auto",
                "tooltip": "Where the text encoder runs. auto: on another GPU than the DiT's when the machine has "
                "several (the first other one with room for its weights), else with the DiT. On a GPU of its own it "
                "stays loaded: a changed prompt is encoded without moving the encoder back first, and its memory is "
                "off the DiT's GPU.",
            },
        ),
        "vae_device": (
            _device_choices(),
            {
                "default": "auto",
                "tooltip": "Where the VAE runs. auto: with the DiT. Another GPU leaves the decode's activations "
                "(the largest at 2048x2048) off the DiT's GPU; the latents move there first.",
            },
        ),
        "gpus": (
            "INT",
            {
                "default": 1,
                "min": 0,
                "max": 16,
                "tooltip": "GPUs the DiT runs on. 1: this one (nothing changes). 2 or more: one worker process per "
                "extra GPU loads its own copy of the DiT at load time; the sampler's `parallel` then splits the "
                "work (CFG branches, or image tokens and heads) over them, with the same result within rounding. "
                "0: every visible GPU. Only tested on CPU over gloo so far: no GPU speed figures yet.",
            },
        ),
    }


def _loaded_sizes(source, formats: WeightFormats, dtype: torch.dtype) -> tuple[int, int] | None:
    """(DiT bytes, text-encoder bytes) once loaded in the chosen formats, from the files' headers; None when a file
    cannot be read yet (the loading itself then reports it, with its name)."""
    part = source.get if isinstance(source, dict) else lambda name: os.path.join(source, name)
    try:
        return (estimated_loaded_bytes(part("transformer"), "transformer", formats.dit, dtype),
                estimated_loaded_bytes(part("text_encoder"), "text_encoder", formats.text_encoder, dtype))  # fmt: skip
    except (OSError, ValueError) as error:
        log.debug("no size estimate before loading (%s)", error)
        return None


def worker_devices(dit: torch.device, gpus: int, cuda_count: int) -> list[torch.device]:
    """The devices of the DiT's extra ranks for `gpus` (0 = every GPU): the GPUs after the DiT's, in order. A DiT on
    the CPU gets CPU ranks (tests: gloo between processes)."""
    if gpus < 0:
        raise ValueError(f"gpus must be >= 0 (0 = every GPU, 1 = one), got {gpus}")
    if dit.type == "cpu":
        if gpus > 1:
            log.warning("gpus is %d but the DiT runs on the CPU (%d CUDA GPU(s) here): starting %d CPU worker "
                        "process(es) over gloo, which tests the several-GPU path and is slower than one process; "
                        "set gpus to 1", gpus, cuda_count, gpus - 1)  # fmt: skip
        return [torch.device("cpu")] * (max(gpus, 1) - 1)
    wanted = cuda_count if gpus == 0 else gpus
    if wanted > cuda_count:
        raise ValueError(f"gpus is {gpus} but this machine has {cuda_count} CUDA GPU(s); lower `gpus` (0 = all)")
    others = [i for i in range(cuda_count) if i != dit.index]
    return [torch.device("cuda", i) for i in others[: wanted - 1]]


def _load(source, weight_dtype: str, device: str, offload_text_encoder="auto", text_encoder_dtype: str = "same",
          text_encoder_device: str = "auto", vae_device: str = "auto", gpus: int = 1) -> Qwen21Model:  # fmt: skip
    offload_text_encoder = memory_adapter.text_encoder_offload(offload_text_encoder)  # a saved workflow's boolean too
    target = host.torch_device() if device == "auto" else torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if weight_dtype not in PRECISIONS or text_encoder_dtype not in TEXT_ENCODER_PRECISIONS:
        got = f"{weight_dtype!r} and {text_encoder_dtype!r}"
        raise ValueError(f"weight_dtype must be one of {list(PRECISIONS)} and text_encoder_dtype one of "
                         f"{list(TEXT_ENCODER_PRECISIONS)}, got {got}")  # fmt: skip
    dtype, dit_format = PRECISIONS[weight_dtype]
    if dtype is None:
        dtype = torch.float32 if target.type == "cpu" else torch.bfloat16
    te_format = dit_format if text_encoder_dtype == "same" else PRECISIONS[text_encoder_dtype][1]
    formats = WeightFormats(dit=dit_format, text_encoder=te_format)
    sizes = _loaded_sizes(source, formats, dtype)  # read off the files' headers once, for both decisions
    cuda_count = torch.cuda.device_count()
    gpu_bytes = [torch.cuda.get_device_properties(i).total_memory for i in range(cuda_count)]
    te_device, vae_target = memory_adapter.component_devices(target, text_encoder_device, vae_device, gpu_bytes,
                                                             sizes[1] if sizes else 0)  # fmt: skip
    te_load = te_device if sizes is None else memory_adapter.text_encoder_load_device(
        target, te_device, *sizes, memory_adapter.LOCAL.budget)  # fmt: skip
    extra = worker_devices(target, gpus, cuda_count)
    names = [os.path.basename(str(part)) for key, part in source.items() if key != "tokenizer"] if isinstance(
        source, dict) else [os.path.basename(str(source))]  # fmt: skip
    log.info("loading Qwen-Image-2.1 from %s: %s on %s (weights %s), text encoder on %s, VAE on %s", ", ".join(names),
             str(dtype).removeprefix("torch."), target, formats.dit, te_device, vae_target)  # fmt: skip
    pipe = Qwen21Pipeline.from_pretrained(
        source,
        device=target,
        dtype=dtype,
        # a memory manager places the text encoder (ComfyUI's or ours, memory/manager.py), not the pipeline
        text_encoder_offload=memory_adapter.evictable(offload_text_encoder),
        weight_formats=formats,
        text_encoder_device=te_device,
        text_encoder_load_device=te_load,
        vae_device=vae_target,
        check_interrupted=host.check_interrupted,  # Cancel also ends a wait for the kernel warm-up
    )
    if extra:
        pipe.start_workers(extra)  # the same DiT file, dtype and formats on each extra device
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


def _outputs(handle: Qwen21Model) -> tuple:
    """The pipeline for our nodes, and the same weights as ComfyUI's MODEL and VAE (None outside ComfyUI)."""
    return handle, handle.comfy_model, handle.comfy_vae()


class _PipelineLoader:
    """What both loaders declare alike: their category and outputs: the pipeline for our nodes, and the same
    weights as ComfyUI's MODEL and VAE (appended after the first output, so older workflows keep their links)."""

    CATEGORY = CATEGORY
    RETURN_TYPES = (MODEL_TYPE, "MODEL", "VAE")
    # names told apart by more than case; the links of saved workflows go by position, so they load as before
    RETURN_NAMES = ("qwen21_model", "MODEL", "VAE")
    OUTPUT_TOOLTIPS = (
        "The loaded pipeline; connect it to the Qwen21 encode, sampler and VAE nodes.",
        "The same DiT as a ComfyUI MODEL: KSampler, every sampler and scheduler, SamplerCustomAdvanced, ComfyUI's "
        "LoRA loaders. Prefix K/V cache, CUDA graphs and quantised weights stay on. Conditioning from Qwen21 Encode "
        "(or native TextEncodeQwenImage21).",
        "The same VAE as a ComfyUI VAE: VAE Decode and VAE Decode (Tiled) give RGB images (Qwen21 VAE Decode gives "
        "the alpha too, as a MASK), VAE Encode.",
    )
    FUNCTION = "load"

    @classmethod
    def VALIDATE_INPUTS(cls, offload_text_encoder):
        """Accept a saved workflow's boolean for offload_text_encoder (the input was an on/off switch before it
        became a choice); ComfyUI then skips its own list check for this input, so the choices are checked here."""
        try:
            memory_adapter.text_encoder_offload(offload_text_encoder)
        except ValueError as error:
            return str(error)
        return True


class Qwen21ModelLoader(_PipelineLoader):
    """Load Qwen-Image-2.1 from the three ComfyUI model files (diffusion model, text encoder, VAE)."""

    DESCRIPTION = __doc__

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "diffusion_model": (
                    host.list_weight_files("diffusion_models"),
                    {"tooltip": "The DiT file from models/diffusion_models (or models/unet), e.g. "
                     "qwen_image_2.1_bf16.safetensors, or a GGUF file (Q8_0 ... Q4_K, Q4_0): its blocks stay "
                     "blocks in memory (weight_dtype auto) and are dequantised right before each GEMM."},
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
            },
            "optional": _placement_inputs(),
        }

    @classmethod
    def IS_CHANGED(cls, diffusion_model, text_encoder, vae, **_inputs):
        """The files' identities: ComfyUI's cache then loads again when a file is replaced under the same name."""
        files = (("diffusion_models", diffusion_model), ("text_encoders", text_encoder), ("vae", vae))
        return tuple(host.file_identity(host.weight_file_path(kind, name)) for kind, name in files)

    def load(self, diffusion_model, text_encoder, vae, weight_dtype, device, offload_text_encoder,
             text_encoder_dtype="same", text_encoder_device="auto", vae_device="auto", gpus=1):  # fmt: skip
        source = {
            "transformer": host.weight_file_path("diffusion_models", diffusion_model),
            "text_encoder": host.weight_file_path("text_encoders", text_encoder),
            "vae": host.weight_file_path("vae", vae),
        }
        tokenizer = _comfyui_tokenizer(source["text_encoder"])
        if tokenizer is not None:
            source["tokenizer"] = tokenizer
        return _outputs(_load(source, weight_dtype, device, offload_text_encoder, text_encoder_dtype,
                              text_encoder_device, vae_device, gpus))  # fmt: skip


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
            },
            "optional": _placement_inputs(),
        }

    @classmethod
    def IS_CHANGED(cls, folder, **_inputs):
        return host.file_identity(host.diffusers_folder_path(folder))  # every file of the folder

    def load(self, folder, weight_dtype, device, offload_text_encoder, text_encoder_dtype="same",
             text_encoder_device="auto", vae_device="auto", gpus=1):  # fmt: skip
        return _outputs(_load(host.diffusers_folder_path(folder), weight_dtype, device, offload_text_encoder,
                              text_encoder_dtype, text_encoder_device, vae_device, gpus))  # fmt: skip
