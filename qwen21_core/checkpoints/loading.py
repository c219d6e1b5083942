"""Load the Qwen-Image-2.1 components from a diffusers folder or from single files (ComfyUI layout).

`load_components(source, device, dtype)` (and `load_pipeline`, the pipeline made of them) takes either

- a diffusers folder: model_index.json, transformer/, vae/, text_encoder/, processor/ (or tokenizer/),
  scheduler/scheduler_config.json; model_index.json's `sample_sigmas` marks a turbo checkpoint; or
- a dict of single files {"transformer": path, "vae": path, "text_encoder": path, "tokenizer": folder},
  the way ComfyUI users keep them in models/diffusion_models, models/vae and models/text_encoders.

Files without a config get one derived from their tensor shapes (transformer, VAE) or the Qwen3-VL-8B
facts (text encoder). Every weight goes through checkpoint.py: identified, checked against the module,
then streamed one tensor at a time into a module that was built without allocating weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3VLConfig, Qwen3VLModel, Qwen3VLProcessor

from ..config import QWEN21_SCHEDULER, PipelineConfig, SchedulerConfig, TransformerConfig, VAEConfig
from ..dit.control import SKIP, FunControlNet
from ..dit.transformer import QUANTIZABLE, QwenImage21Transformer
from ..quant.linear import QuantLinear
from ..quant.plan import CHOICES, WeightFormats, choose, dit_stored_formats
from ..quant.slots import quant_slots
from ..quant.weights import QuantFormat
from ..text.encoder import QWEN3_VL_8B_CONFIG, QWEN3_VL_IMAGE_PROCESSOR, Qwen21TextEncoder, decoder_linear_names
from ..vae.model import QwenImage21VAE
from . import formats, key_maps
from .files import (
    Checkpoint,
    CheckpointMismatchError,
    Layout,
    WrongModelError,
    build_empty,
    converted_shapes,
    gguf_type,
    identify,
    load_into,
    module_slots,
)
from .gguf_files import foreign_architecture

log = logging.getLogger(__name__)

PIPELINE_CLASS = "QwenImage21Pipeline"
COMPONENT_CLASSES = {"transformer": "QwenImage21Transformer2DModel", "vae": "AutoencoderKLQwenImage21"}
SINGLE_FILE_KEYS = ("transformer", "vae", "text_encoder", "tokenizer")
# The quantised text encoder multiplies in bf16 with its weights dequantised per layer (weight-only), as native
# ComfyUI runs fp8 text encoders: with the activations quantised too (W8A8), the per-GEMM error compounds over
# its 36 layers (the full-size random encoder's embeddings lost far more PSNR against bf16 than weight-only), and
# the encoder runs once per prompt, so its GEMM speed matters little; the weights' memory is the same either way.
TEXT_ENCODER_QUANTIZES_ACTIVATIONS = False
# Where ComfyUI keeps the Qwen tokenizer its Qwen3-VL text encoders use (comfy/text_encoders/qwen3vl.py).
COMFYUI_TOKENIZER_DIR = Path("comfy") / "text_encoders" / "qwen25_tokenizer"
# Pipelines whose model_index.json means "a different model", with what to call them.
_OTHER_PIPELINES = {
    "QwenImage": "Qwen-Image 1.x",
    "Wan": "Wan",
    "Flux": "Flux",
    "StableDiffusion": "Stable Diffusion",
}


@dataclass
class Components:
    """Everything a pipeline needs, loaded and placed.

    sources: component -> facts for logs and the UI: path, layout, stored (weight format found), dtype,
             device, config (where the config came from).
    """

    transformer: QwenImage21Transformer
    vae: QwenImage21VAE
    text_encoder: Qwen21TextEncoder | None
    scheduler_config: SchedulerConfig
    pipeline_config: PipelineConfig
    sources: dict[str, dict[str, str]] = field(default_factory=dict)


def load_components(
    source: str | os.PathLike | Mapping[str, str | os.PathLike],
    device: str | torch.device | None,
    dtype: torch.dtype,
    *,
    text_encoder_device: str | torch.device | None = None,
    vae_device: str | torch.device | None = None,
    text_encoder_dtype: torch.dtype | None = None,
    vae_dtype: torch.dtype | None = None,
    load_text_encoder: bool = True,
    weight_formats: WeightFormats | None = None,
) -> Components:
    """Load transformer, VAE and (optionally) text encoder; see the module docstring for `source`.

    device None picks CUDA when available. The VAE and the text encoder default to the transformer's
    dtype and device (text_encoder_device, vae_device: elsewhere). weight_formats: which Linears are quantised,
    in what format (quant/plan.py); dtype is the compute dtype.
    """
    device = _resolve_device(device)
    dtype = _check_dtype(dtype, "dtype")
    vae_dtype = _check_dtype(vae_dtype or dtype, "vae_dtype")
    te_dtype = _check_dtype(text_encoder_dtype or dtype, "text_encoder_dtype")
    te_device = _resolve_device(text_encoder_device) if text_encoder_device is not None else device
    vae_device = _resolve_device(vae_device) if vae_device is not None else device

    if isinstance(source, Mapping):
        paths, scheduler_config, pipeline_config = _single_files(source, load_text_encoder)
    else:
        paths, scheduler_config, pipeline_config = _diffusers_folder(Path(source))

    transformer, transformer_info = load_transformer(paths["transformer"], device, dtype, None, weight_formats)
    vae, vae_info = load_vae(paths["vae"], vae_device, vae_dtype)
    if vae.config.z_dim != transformer.config.in_channels:
        raise ValueError(
            f"the VAE ({paths['vae']}) has z_dim {vae.config.z_dim} but the transformer reads "
            f"{transformer.config.in_channels} latent channels; they are not from the same model"
        )
    sources = {"transformer": transformer_info, "vae": vae_info}
    text_encoder = None
    if load_text_encoder:
        text_encoder, te_info = load_qwen3vl(
            paths["text_encoder"], te_device, te_dtype, tokenizer=paths.get("tokenizer"), weight_formats=weight_formats
        )
        if text_encoder.hidden_size != transformer.config.context_in_dim:
            raise ValueError(
                f"the text encoder ({paths['text_encoder']}) has hidden size {text_encoder.hidden_size} but the "
                f"transformer reads {transformer.config.context_in_dim}; Qwen-Image-2.1 needs its Qwen3-VL-8B"
            )
        sources["text_encoder"] = te_info
    return Components(transformer, vae, text_encoder, scheduler_config, pipeline_config, sources)


def load_pipeline(cls, source, device=None, dtype: torch.dtype = torch.bfloat16, *,
                  text_encoder_dtype: torch.dtype | None = None, vae_dtype: torch.dtype | None = None,
                  text_encoder_offload: bool = True, load_text_encoder: bool = True,
                  weight_formats: WeightFormats | None = None, text_encoder_device=None, vae_device=None,
                  text_encoder_load_device=None, check_interrupted: Callable[[], None] | None = None):  # fmt: skip
    """A `cls` (Qwen21Pipeline) from a diffusers folder or a dict of ComfyUI single files (see `load_components`),
    its kernel warm-up started: `Qwen21Pipeline.from_pretrained`.

    device None picks CUDA when available; dtype: the compute dtype; weight_formats: which Linears stay or become
    quantised (quant/plan.py; the default keeps each file's own format). text_encoder_device / vae_device: where
    those run (default: the DiT's device); a text encoder on a device of its own is never offloaded.
    text_encoder_load_device: where the text encoder's weights are read to (default: where it runs; the CPU when they
    do not fit there, see memory/manager.py text_encoder_load_device): a memory manager then places them on first
    use. check_interrupted: raises when the user cancels (ComfyUI's check); waits for the kernel warm-up call it.
    """
    from ..memory.manager import own_gpu
    from ..memory.planner import indexed_device
    from ..startup.priming import prime

    device = _resolve_device(device)
    prime(device)  # torch's and Triton's own kernels load while the files are read (startup/priming.py)
    parts = load_components(source, device, dtype, text_encoder_device=text_encoder_load_device or text_encoder_device,
                            vae_device=vae_device, text_encoder_dtype=text_encoder_dtype, vae_dtype=vae_dtype,
                            load_text_encoder=load_text_encoder, weight_formats=weight_formats)  # fmt: skip
    encoder = parts.text_encoder
    runs_on = indexed_device(text_encoder_device if text_encoder_device is not None else device)
    if encoder is not None:
        encoder.device = runs_on  # where it encodes, wherever its weights were read to
    own_device = encoder is not None and own_gpu(runs_on, device)
    pipe = cls(parts.transformer, parts.vae, encoder, parts.scheduler_config, parts.pipeline_config,
               text_encoder_offload=text_encoder_offload and not own_device, sources=parts.sources)  # fmt: skip
    pipe.weight_formats = weight_formats or WeightFormats()
    pipe.check_interrupted = check_interrupted
    pipe.start_kernel_warmup()
    return pipe


# ---------------------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------------------


def _single_files(source: Mapping, load_text_encoder: bool) -> tuple[dict[str, Path], SchedulerConfig, PipelineConfig]:
    unknown = sorted(set(source) - set(SINGLE_FILE_KEYS))
    if unknown:
        raise ValueError(f"single-file source has unknown entries {unknown}; expected keys among {SINGLE_FILE_KEYS}")
    needed = ["transformer", "vae"] + (["text_encoder"] if load_text_encoder else [])
    absent = [name for name in needed if not source.get(name)]
    if absent:
        raise ValueError(f"single-file source needs paths for {absent} (got {sorted(source)})")
    paths = {name: Path(value) for name, value in source.items() if value}
    return paths, QWEN21_SCHEDULER, PipelineConfig()


def _diffusers_folder(root: Path) -> tuple[dict[str, Path], SchedulerConfig, PipelineConfig]:
    if root.is_file():
        raise ValueError(
            f"{root} is a file; pass a diffusers folder (with model_index.json) or a dict "
            "{'transformer': ..., 'vae': ..., 'text_encoder': ...} of single files"
        )
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path} not found: {root} is not a diffusers pipeline folder")
    index = json.loads(index_path.read_text(encoding="utf-8"))
    class_name = index.get("_class_name", "")
    if not class_name.startswith("QwenImage21"):
        family = next((name for prefix, name in _OTHER_PIPELINES.items() if class_name.startswith(prefix)), None)
        what = f"a {family} pipeline ({class_name})" if family else f"a {class_name or 'unnamed'} pipeline"
        raise WrongModelError(f"{root}: expected a Qwen-Image-2.1 diffusers folder ({PIPELINE_CLASS}), found {what}")
    for name in ("transformer", "vae", "text_encoder"):
        if not (root / name).is_dir():
            raise FileNotFoundError(f"{root / name} not found: the diffusers folder is incomplete")
    tokenizer = next((root / name for name in ("processor", "tokenizer") if (root / name).is_dir()), None)
    paths = {name: root / name for name in ("transformer", "vae", "text_encoder")}
    paths["tokenizer"] = tokenizer

    scheduler_path = root / "scheduler" / "scheduler_config.json"
    if scheduler_path.is_file():
        scheduler_config = SchedulerConfig.from_json_file(scheduler_path)
    else:
        log.warning("%s missing; using the released Qwen-Image-2.1 scheduler settings", scheduler_path)
        scheduler_config = QWEN21_SCHEDULER
    components = {"scheduler", "vae", "text_encoder", "processor", "tokenizer", "transformer"}
    sigmas = index.get("sample_sigmas")
    extra = {k: v for k, v in index.items() if not k.startswith("_") and k not in components | {"sample_sigmas"}}
    pipeline_config = PipelineConfig(sample_sigmas=tuple(sigmas) if sigmas else None, extra=extra)
    return paths, scheduler_config, pipeline_config


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _check_dtype(dtype, what: str) -> torch.dtype:
    if dtype not in formats.FLOAT_DTYPES:
        raise TypeError(f"{what} must be one of {formats.FLOAT_DTYPES}, got {dtype!r}")
    return dtype


def _open(path: Path, component: str) -> tuple[Checkpoint, Layout, formats.QuantScheme]:
    ckpt = Checkpoint.open(path)
    try:
        if ckpt.is_gguf:
            return ckpt, _identify_gguf(ckpt, component), formats.QuantScheme(name="GGUF")
        layout = identify(ckpt, component)
        quant = formats.inspect(str(ckpt.path), ckpt.keys(), ckpt.dtype, ckpt.metadata, ckpt.read)
    except BaseException:
        ckpt.close()
        raise
    return ckpt, layout, quant


def _identify_gguf(ckpt: Checkpoint, component: str) -> Layout:
    """A GGUF file's layout: only Qwen-Image-2.1's diffusion model is read from GGUF (its architecture, if the file
    names one, is Qwen-Image's; the tensor names say the rest, as for a safetensors file)."""
    arch = foreign_architecture(ckpt.metadata)
    if arch is not None:
        raise WrongModelError(f"{ckpt.path}: a GGUF of architecture {arch!r}; the Qwen-Image-2.1 diffusion model's "
                              "GGUF files name qwen_image21 (or qwen_image, or nothing)")  # fmt: skip
    if component != "transformer":
        raise WrongModelError(f"{ckpt.path}: a GGUF file; qwen21-nodes reads the diffusion model from GGUF, the "
                              f"{component.replace('_', ' ')} from .safetensors only")  # fmt: skip
    return identify(ckpt, component)


def _gguf_types(ckpt: Checkpoint, convert) -> dict[str, str]:
    """Diffusers name -> GGUF type ("Q4_K", "BF16", ...) of every tensor of a GGUF file."""
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    out = {}
    for key, info in ckpt.tensors.items():
        qtype = gguf_type(info) or names.get(info.dtype, str(info.dtype))
        for name, _ in convert(key, torch.empty(info.shape, device="meta")):
            out[name] = qtype
    return out


def _config_file(path: Path, explicit) -> Path | None:
    """The config for the weights at `path`: `explicit`, else config.json in a component folder, else a sidecar
    `<file stem>.json` next to a single file; None if there is none."""
    if explicit is not None:
        return Path(explicit)
    candidate = path / "config.json" if path.is_dir() else path.with_suffix(".json")
    return candidate if candidate.is_file() else None


def _check_class(config_path: Path, expected: str) -> dict:
    data = json.loads(config_path.read_text(encoding="utf-8"))
    found = data.get("_class_name", expected)
    if found != expected:
        raise WrongModelError(f"{config_path}: expected a {expected} config, found {found}")
    return data


def _info(ckpt: Checkpoint, layout: Layout, quant, dtype, device, config_from: str) -> dict[str, str]:
    return {
        "path": str(ckpt.path),
        "layout": layout.name,
        "stored": quant.name,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "config": config_from,
    }


# ---------------------------------------------------------------------------------------------------------
# Transformer and VAE
# ---------------------------------------------------------------------------------------------------------


def _load_model(path, device, dtype, config_path, component, config_cls, config_from_shapes, build, what):
    """Shared by the DiT and the VAE: open, detect the layout, find or derive the config, build, fill.

    build(config, stored) -> the module (on meta); stored: diffusers name -> QuantFormat of the file's
    quantised weights (the DiT uses it to choose its quantised layers).
    """
    device, dtype = _resolve_device(device), _check_dtype(dtype, "dtype")
    config_path = _config_file(Path(path), config_path)
    ckpt, layout, quant = _open(Path(path), component)
    with ckpt:
        convert = key_maps.converter(layout, ckpt.keys())
        if config_path is not None:
            config = config_cls.from_dict(_check_class(config_path, COMPONENT_CLASSES[component]))
            config_from = str(config_path)
            _check_config_fits(config, config_path, _shapes(ckpt, convert, quant), config_from_shapes)
        else:
            config = config_from_shapes(_shapes(ckpt, convert, quant))
            config_from = "derived from tensor shapes"
        stored = _gguf_types(ckpt, convert) if ckpt.is_gguf else _stored_formats(quant, convert)
        model = build_empty(lambda: build(config, stored), device, dtype)
        load_into(module_slots(model), ckpt, convert, what=what, quant=quant)
        info = _info(ckpt, layout, quant, dtype, device, config_from)
    log.debug("%s: %s", component, info)
    return model, info


# What a config says that the weights' shapes show too (the rest, such as the rotary split, is not stored)
_STRUCTURE = {TransformerConfig: ("in_channels", "out_channels", "num_layers", "attention_head_dim",
                                  "num_attention_heads", "context_in_dim", "mlp_ratio"),
              VAEConfig: ("base_dim", "decoder_base_dim", "z_dim", "dim_mult", "num_res_blocks", "in_channels",
                          "out_channels")}  # fmt: skip


def _check_config_fits(config, config_path: Path, shapes, config_from_shapes) -> None:
    """A config file beside downloaded weights is checked against the weights' header before anything is built from
    it: a config that claims 100,000 layers would otherwise size (and allocate) the model first."""
    try:
        derived = config_from_shapes(shapes)
    except CheckpointMismatchError:
        return  # the weights lack what the sizes are read from: the load itself names what is missing
    wrong = [f"{field} {getattr(config, field)!r} (the weights: {getattr(derived, field)!r})"
             for field in _STRUCTURE[type(config)] if getattr(config, field) != getattr(derived, field)]  # fmt: skip
    if wrong:
        raise CheckpointMismatchError(f"{config_path} does not fit the weights beside it: it says {'; '.join(wrong)}. "
                                      "Use the config that came with these weights, or remove it")  # fmt: skip


def _stored_formats(quant: formats.QuantScheme, convert) -> dict[str, QuantFormat]:
    """Converted (diffusers) weight name -> in-memory format of each quantised checkpoint weight."""
    out = {}
    for key, layer in quant.layers.items():
        fmt = layer.fmt or QuantFormat("fp8")  # e5m2 weights run as e4m3 (requantised at load)
        for name, _ in convert(key, torch.empty(0, device="meta")):
            out[name] = fmt
    return out


QUANTIZED_CHOICES = ("fp8", "int8", "int8_convrot")


def estimated_loaded_bytes(path: str | os.PathLike, component: str, choice: str, dtype: torch.dtype) -> int:
    """About how many bytes a component's weights take once loaded, from its file's header alone (for placement
    decisions before loading): the Linear weights the format `choice` quantises (or that the file stores in 8 bits
    and "auto" keeps) at one byte per value, everything else in `dtype`, per-row scales in fp32; the text
    encoder's language-model head, which is never loaded, left out. component: "transformer" or "text_encoder"."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    with Checkpoint.open(path) as ckpt:
        for name, info in ckpt.tensors.items():
            if "lm_head" in name:
                continue
            count = 1
            for size in info.shape:
                count *= size
            stored_8bit = isinstance(info.dtype, torch.dtype) and info.dtype.itemsize == 1
            linear = len(info.shape) == 2 and _quantisable_name(component, name)
            if gguf_type(info) is not None and linear and choice == "auto":  # GGUF blocks stay blocks
                total += info.nbytes
            elif linear and (choice in QUANTIZED_CHOICES or (choice == "auto" and stored_8bit)):
                total += count
            elif info.dtype == torch.float32 and len(info.shape) <= 1:
                total += count * 4
            else:
                total += count * element
    return total


def _quantisable_name(component: str, name: str) -> bool:
    """A weight the loaders may quantise (quant/plan.py): the DiT's block Linears, the text encoder's decoder ones."""
    if component == "transformer":
        return "transformer_blocks." in name
    return ".layers." in f".{name}" and "visual" not in name


def load_transformer(
    path: str | os.PathLike,
    device,
    dtype: torch.dtype,
    config_path: str | os.PathLike | None = None,
    weight_formats: WeightFormats | None = None,
) -> tuple[QwenImage21Transformer, dict[str, str]]:
    """A diffusers transformer folder or a (ComfyUI or diffusers layout) single file -> our transformer.

    weight_formats.dit / .keep choose its quantised block Linears (quant/plan.py); dtype is the compute dtype.
    """
    weight_formats = weight_formats or WeightFormats()

    def build(config, stored):
        # in `dtype` before quantising: a QuantLinear computes in the dtype of the Linear it replaces
        model = QwenImage21Transformer(config).to(dtype)
        gguf = stored and all(isinstance(fmt, str) for fmt in stored.values())  # a GGUF file's types
        if gguf and weight_formats.dit == "auto":  # its blocks stay blocks; another choice dequantises at load
            return model.use_gguf_linears(model.gguf_plan(stored))
        candidates = [(i, path) for i in range(config.num_layers) for path in QUANTIZABLE]
        plan = choose(weight_formats.dit, candidates, {} if gguf else dit_stored_formats(stored), weight_formats.keep)
        return model.quantize_linears(plan)

    model, info = _load_model(
        path, device, dtype, config_path, "transformer", TransformerConfig, transformer_config_from_shapes, build,
        "Qwen-Image-2.1 transformer",
    )  # fmt: skip
    info["weights"] = model.quantization
    return model, info


MAX_CONTROL_BLOCKS = 64  # the released branch has 16; a header claiming more is not a Fun-Control file


def load_fun_control(path: str | os.PathLike, base: TransformerConfig, device, dtype: torch.dtype,
                     weight_format: str = "auto") -> tuple[FunControlNet, dict[str, str]]:  # fmt: skip
    """A Qwen-Image-2.1 Fun-Controlnet-Union file (alibaba-pai's original, ComfyUI's repack with the same tensors, or a
    fused-MLP or quantised ComfyUI file) -> our control branch for a DiT of config `base`. Its blocks must match the
    DiT's width and heads (a file for another model is refused by name); weight_format as the DiT's (quant/plan.py):
    "auto" keeps a quantised file's format, "fp8" / "int8" / "int8_convrot" quantise the control blocks' Linears and
    their skips (after_proj)."""
    device, dtype = _resolve_device(device), _check_dtype(dtype, "dtype")
    if weight_format not in CHOICES:
        raise ValueError(f"weight format must be one of {CHOICES}, got {weight_format!r}")
    ckpt = Checkpoint.open(Path(path))
    with ckpt:
        if ckpt.is_gguf:
            raise WrongModelError(f"{ckpt.path}: a GGUF file; Fun-Control files are read from .safetensors only")
        layout = identify(ckpt, "control")
        quant = formats.inspect(str(ckpt.path), ckpt.keys(), ckpt.dtype, ckpt.metadata, ckpt.read)
        convert = key_maps.converter(layout, ckpt.keys())
        shapes = _shapes(ckpt, convert, quant)
        config, blocks, channels = _control_config(ckpt.path, shapes, base)
        # the skips a quantised file stores in 8 bits are kept so under "auto", as its blocks' Linears
        stored = dit_stored_formats(_stored_formats(quant, convert), stack="control_blocks", extra={SKIP: SKIP})
        candidates = [(i, name) for i in range(blocks) for name in (*QUANTIZABLE, SKIP)]
        plan = choose(weight_format, candidates, stored)
        model = build_empty(lambda: FunControlNet(config, blocks, channels).to(dtype).quantize_linears(plan),
                            device, dtype)  # fmt: skip
        load_into(module_slots(model), ckpt, convert, what="Qwen-Image-2.1 Fun-Control", quant=quant)
        info = _info(ckpt, layout, quant, dtype, device, "derived from tensor shapes")
    info["weights"] = model.quantization
    info["blocks"] = str(blocks)
    log.debug("control: %s", info)
    return model, info


def fun_control_from_state_dict(state_dict: Mapping[str, torch.Tensor], base: TransformerConfig, device,
                                dtype: torch.dtype, what: str = "a Fun-Control module") -> FunControlNet:  # fmt: skip
    """Our control branch from another implementation's module state (native ComfyUI's QwenImage21FunControl: the
    file's names, split or fused MLP), checked as a file is; its float weights are copied in `dtype` on `device`."""
    convert = key_maps.converter(Layout("control", "diffusers"), state_dict.keys())
    tensors = {}
    for key, tensor in state_dict.items():
        if not tensor.is_floating_point() or tensor.element_size() < 2:
            raise WrongModelError(f"{what}: {key} is stored as {tensor.dtype}; only float weights are taken over from "
                                  "another loader: load the file with Qwen21 Load Fun Control instead")  # fmt: skip
        tensors.update(convert(key, tensor))
    shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
    config, blocks, channels = _control_config(what, shapes, base)
    model = build_empty(lambda: FunControlNet(config, blocks, channels), device, dtype)
    slots = model.checkpoint_slots()
    missing, unexpected = sorted(set(slots) - set(tensors)), sorted(set(tensors) - set(slots))
    if missing or unexpected:
        raise CheckpointMismatchError(f"{what}: missing {missing[:4]}, unexpected {unexpected[:4]}")
    with torch.no_grad():
        for name, slot in slots.items():
            slot.copy_(tensors[name])
    return model


def _control_config(path, shapes: Mapping[str, tuple[int, ...]], base: TransformerConfig):
    """(config, number of blocks, context channels) of a Fun-Control file, checked against the DiT's config."""
    blocks = {int(m.group(1)) for k in shapes if (m := re.fullmatch(r"control_blocks\.(\d+)\.after_proj\.weight", k))}
    if not blocks or blocks != set(range(len(blocks))) or len(blocks) > MAX_CONTROL_BLOCKS:
        raise CheckpointMismatchError(f"{path}: its control blocks are numbered {sorted(blocks)[:8]}...; a "
                                      f"Fun-Control file numbers 1 to {MAX_CONTROL_BLOCKS} blocks from 0")  # fmt: skip
    inner, channels = _need(shapes, "control_img_in.weight", "Fun-Control")
    head_dim = _need(shapes, "control_blocks.0.attn.norm_q.weight", "Fun-Control")[0]
    hidden = _need(shapes, "control_blocks.0.img_mlp.proj.weight", "Fun-Control")[0]
    if inner != base.inner_dim or head_dim != base.attention_head_dim or hidden % inner:
        raise WrongModelError(f"{path}: a Fun-Control branch {inner} wide with {head_dim}-wide heads, for another "
                              f"model than this DiT ({base.inner_dim} wide, {base.attention_head_dim}-wide "
                              "heads)")  # fmt: skip
    if len(blocks) > base.num_layers:
        raise WrongModelError(f"{path}: {len(blocks)} control blocks for a DiT of {base.num_layers} blocks")
    expected = 2 * base.in_channels + 1  # control latents, keep mask, masked-image latents
    if channels != expected:
        raise WrongModelError(f"{path}: its control input takes {channels} channels; Qwen-Image-2.1's Fun-Control "
                              f"takes {expected} (control latents, mask, inpaint latents)")  # fmt: skip
    return dataclasses.replace(base, mlp_ratio=hidden // inner), len(blocks), channels


def load_vae(
    path: str | os.PathLike, device, dtype: torch.dtype, config_path: str | os.PathLike | None = None
) -> tuple[QwenImage21VAE, dict[str, str]]:
    """A diffusers VAE folder or a (ComfyUI Wan 2.2 or diffusers layout) single file -> our VAE."""
    return _load_model(
        path, device, dtype, config_path, "vae", VAEConfig, vae_config_from_shapes,
        lambda config, _stored: QwenImage21VAE(config), "Qwen-Image-2.1 VAE",
    )  # fmt: skip


def _shapes(ckpt: Checkpoint, convert, quant) -> dict[str, tuple[int, ...]]:
    return {name: shape for name, (_, shape) in converted_shapes(ckpt, convert, quant).items()}


def _need(shapes: Mapping[str, tuple[int, ...]], key: str, what: str) -> tuple[int, ...]:
    if key not in shapes:
        raise CheckpointMismatchError(f"cannot derive the {what} config from the checkpoint: {key} is missing")
    return shapes[key]


def transformer_config_from_shapes(shapes: Mapping[str, tuple[int, ...]]) -> TransformerConfig:
    """The config a diffusers-named transformer state dict was built with, read off its shapes.

    Only the rotary split is not stored: the released (16, 56, 56) for 128-wide heads, scaled for others
    (an eighth of the head for frames, the rest split evenly between height and width).
    """
    layers = {int(m.group(1)) for k in shapes if (m := re.match(r"transformer_blocks\.(\d+)\.attn\.to_q\.weight", k))}
    head_dim = _need(shapes, "transformer_blocks.0.attn.norm_q.weight", "transformer")[0]
    inner = _need(shapes, "transformer_blocks.0.attn.to_q.weight", "transformer")[0]
    hidden = _need(shapes, "transformer_blocks.0.img_mlp.proj.weight", "transformer")[0]
    frames = 2 * max(1, head_dim // 16)
    return TransformerConfig(
        in_channels=_need(shapes, "img_in.weight", "transformer")[1],
        out_channels=_need(shapes, "proj_out.weight", "transformer")[0],
        num_layers=len(layers),
        attention_head_dim=head_dim,
        num_attention_heads=inner // head_dim,
        context_in_dim=_need(shapes, "txt_in.in_layer.weight", "transformer")[1],
        mlp_ratio=hidden // inner,
        axes_dims_rope=(frames, (head_dim - frames) // 2, (head_dim - frames) // 2),
    )


def vae_config_from_shapes(shapes: Mapping[str, tuple[int, ...]]) -> VAEConfig:
    """The config a diffusers-named VAE state dict was built with, read off its shapes.

    latents_mean/std are not stored in the weights; the released values need z_dim 64.
    """
    base_dim, in_channels = _need(shapes, "encoder.conv_in.weight", "VAE")[:2]
    stages = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"encoder\.down_blocks\.(\d+)\.", k))})
    resnets = {int(m.group(1)) for k in shapes if (m := re.match(r"encoder\.down_blocks\.0\.resnets\.(\d+)\.", k))}
    extra_attention = [k for k in shapes if ".attentions." in k and ".mid_block." not in k]
    if extra_attention:
        raise CheckpointMismatchError(f"VAE has attention outside the mid blocks, not supported: {extra_attention[:3]}")
    z_dim = _need(shapes, "post_quant_conv.weight", "VAE")[0]
    if z_dim != len(VAEConfig().latents_mean):
        raise CheckpointMismatchError(
            f"VAE with z_dim {z_dim}: its latents_mean/std are not in the weights and only the released 64-channel "
            "values are known; load it from a diffusers folder with its config.json"
        )
    return VAEConfig(
        base_dim=base_dim,
        decoder_base_dim=_need(shapes, "decoder.norm_out.gamma", "VAE")[0],
        z_dim=z_dim,
        dim_mult=tuple(
            _need(shapes, f"encoder.down_blocks.{i}.resnets.0.conv1.weight", "VAE")[0] // base_dim for i in stages
        ),
        num_res_blocks=len(resnets),
        temperal_downsample=tuple(
            f"encoder.down_blocks.{i}.downsampler.time_conv.weight" in shapes for i in stages[:-1]
        ),
        in_channels=in_channels,
        out_channels=_need(shapes, "decoder.conv_out.weight", "VAE")[0],
    )


# ---------------------------------------------------------------------------------------------------------
# Text encoder
# ---------------------------------------------------------------------------------------------------------


def load_qwen3vl(
    path: str | os.PathLike,
    device,
    dtype: torch.dtype,
    *,
    tokenizer: str | os.PathLike | None = None,
    config_path: str | os.PathLike | None = None,
    weight_formats: WeightFormats | None = None,
) -> tuple[Qwen21TextEncoder, dict[str, str]]:
    """Qwen3-VL weights (a diffusers text_encoder/ folder or a single file) + its processor -> Qwen21TextEncoder.

    Only the vision tower and the language model are built: the language-model head (0.6 B parameters) is
    read past and dropped, since the encoder only needs hidden states. The config comes from `config_path`,
    else config.json in a text_encoder/ folder or a sidecar `<file stem>.json` next to a single file, else
    from the Qwen3-VL-8B facts.
    """
    device, dtype = _resolve_device(device), _check_dtype(dtype, "dtype")
    path = Path(path)
    ckpt, layout, quant = _open(path, "text_encoder")
    with ckpt, ThreadPoolExecutor(1, thread_name_prefix="qwen21-processor") as side:
        processor_dir = find_tokenizer(path, tokenizer)  # before the weights: a missing tokenizer fails fast
        # the processor (slow to read, mostly the tokenizer's vocabulary) is read while the weights stream in
        _import_processor_modules()
        processor = side.submit(load_processor, processor_dir)
        config, config_from = _text_encoder_config(ckpt, path, config_path)
        config.dtype = dtype
        convert = key_maps.converter(layout, ckpt.keys())
        stored = _stored_formats(quant, convert)
        choice = (weight_formats or WeightFormats()).text_encoder

        def build():
            with _no_weight_init():
                model = Qwen3VLModel(config)
            # Our canonical names are the transformers Qwen3VLForConditionalGeneration ones ("model." + path).
            stored_layers = {name[len("model.") : -len(".weight")]: fmt for name, fmt in stored.items()}
            linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
            candidates = decoder_linear_names(model)
            candidates += [name for name in linears if name in stored_layers and name not in candidates]
            plan = choose(choice, candidates, stored_layers)
            for name, fmt in plan.items():
                parent, _, child = name.rpartition(".")
                linear = linears[name]
                layer = QuantLinear(linear.in_features, linear.out_features, fmt, compute_dtype=dtype,
                                    quantize_activations=TEXT_ENCODER_QUANTIZES_ACTIVATIONS)  # fmt: skip
                setattr(model.get_submodule(parent), child, layer)
            return model

        model = build_empty(build, device, dtype)
        slots = {f"model.{name}": tensor for name, tensor in quant_slots(model, module_slots(model)).items()}
        slots["lm_head.weight"] = None
        load_into(slots, ckpt, convert, what="Qwen3-VL text encoder", quant=quant)
        info = _info(ckpt, layout, quant, dtype, device, config_from)
        info["weights"] = _describe_linears(model)
        info["tokenizer"] = str(processor_dir)
        log.debug("text encoder: %s", info)
        return Qwen21TextEncoder(model, processor.result()), info


def _no_weight_init():
    """transformers' own weight initialisation skipped (every weight is read from the file next): on the meta
    parameters build_empty gives, initialising Qwen3-VL-8B's modules was a noticeable share of a load's Python time
    (in a profile of the load), and all of it wasted. Buffers computed in __init__ (the rotary frequencies) are kept.
    transformers swaps torch's init functions for no-ops process-wide meanwhile; the build is the only thing making
    modules then."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # a transformers without it: the initialisation runs, as before
        return contextlib.nullcontext()
    return no_init_weights()


def _describe_linears(model: nn.Module) -> str:
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    quantized = [m for m in linears if isinstance(m, QuantLinear)]
    if not quantized:
        return "float"
    names = "/".join(sorted({m.fmt.name for m in quantized}))
    return f"{names} ({len(quantized)}/{len(linears)} linears)"


def _text_encoder_config(ckpt: Checkpoint, path: Path, config_path) -> tuple[Qwen3VLConfig, str]:
    config_path = _config_file(path, config_path)
    norm = next((k for k in ("model.language_model.norm.weight", "model.norm.weight") if k in ckpt), None)
    hidden = ckpt.shape(norm)[0] if norm is not None else None
    layer_key = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.")
    layers = len({m.group(1) for k in ckpt.keys() if (m := layer_key.match(k))})
    if config_path is not None:
        data = json.loads(config_path.read_text(encoding="utf-8"))
        if data.get("model_type") != "qwen3_vl":
            raise WrongModelError(f"{config_path}: not a Qwen3-VL config (model_type {data.get('model_type')!r})")
        text = data.get("text_config") if isinstance(data.get("text_config"), dict) else {}
        says = (text.get("hidden_size", hidden), text.get("num_hidden_layers", layers))
        if hidden is not None and says != (hidden, layers):  # before a model is sized from it
            raise CheckpointMismatchError(
                f"{config_path} does not fit the weights beside it: it says hidden size {says[0]!r:.20} and "
                f"{says[1]!r:.20} layers, the weights have {hidden} and {layers}. Use the config that came with "
                "these weights, or remove it"
            )
        return Qwen3VLConfig.from_dict(data), str(config_path)

    if norm is None:
        raise WrongModelError(f"{ckpt.path}: no language-model norm weight: not a Qwen3-VL text encoder")
    facts = QWEN3_VL_8B_CONFIG["text_config"]
    if (hidden, layers) != (facts["hidden_size"], facts["num_hidden_layers"]):
        size = " (Qwen3-VL-4B)" if hidden == 2560 else ""
        raise WrongModelError(
            f"{ckpt.path}: a Qwen3-VL text encoder with hidden size {hidden} and {layers} layers{size}, but "
            f"Qwen-Image-2.1 uses Qwen3-VL-8B ({facts['hidden_size']}, {facts['num_hidden_layers']}). To load "
            f"another size anyway, put its transformers config.json next to it as {path.with_suffix('.json').name}"
        )
    return Qwen3VLConfig.from_dict(QWEN3_VL_8B_CONFIG), "Qwen3-VL-8B facts"


def find_tokenizer(text_encoder_path: str | os.PathLike, explicit: str | os.PathLike | None = None) -> Path:
    """The folder holding the Qwen3-VL processor or tokenizer for a text encoder.

    Looked for, in order: `explicit`; processor/ or tokenizer/ beside a diffusers text_encoder/ folder; next
    to a single file (a folder named after it, processor/, tokenizer/, or tokenizer files right there);
    inside the ComfyUI installation above it (comfy/text_encoders/qwen25_tokenizer).
    """
    if explicit is not None:
        explicit = Path(explicit)
        for candidate in (explicit, explicit / "processor", explicit / "tokenizer"):
            if _has_tokenizer(candidate):
                return candidate
        raise FileNotFoundError(f"tokenizer folder {explicit} has no tokenizer files (tokenizer.json or vocab.json)")

    path = Path(text_encoder_path).resolve()
    near = path.parent  # the diffusers root for a text_encoder/ folder, the file's folder otherwise
    candidates = [near / "processor", near / "tokenizer"]
    if path.is_file():
        candidates = [near / path.stem, *candidates, near]
    candidates += [parent / COMFYUI_TOKENIZER_DIR for parent in path.parents]
    for candidate in candidates:
        if _has_tokenizer(candidate):
            return candidate
    raise FileNotFoundError(
        f"no Qwen3-VL tokenizer found for {text_encoder_path}. Looked in {[str(c) for c in candidates[:4]]} and for "
        f"{COMFYUI_TOKENIZER_DIR} in every folder above it. Pass the folder as the 'tokenizer' entry."
    )


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() or (folder / "vocab.json").is_file()


# What a Qwen3-VL processor is built from (transformers imports them on first use)
_PROCESSOR_MODULES = (
    "transformers.models.qwen2.tokenization_qwen2",
    "transformers.models.qwen2_vl.image_processing_qwen2_vl",
    "transformers.models.qwen2_vl.image_processing_qwen2_vl_fast",
    "transformers.models.qwen3_vl.video_processing_qwen3_vl",
    "transformers.models.qwen3_vl.processing_qwen3_vl",
)


def _import_processor_modules() -> None:
    """Import what `load_processor` uses on the caller's thread: the processor is then read in another thread, and
    imports racing between threads can deadlock Python's import locks. A module this transformers lacks is skipped."""
    for name in _PROCESSOR_MODULES:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def load_processor(folder: str | os.PathLike) -> Qwen3VLProcessor:
    """The Qwen3VLProcessor in `folder`; for a bare tokenizer folder (ComfyUI's), one built from Qwen3-VL facts."""
    folder = Path(folder)
    if (folder / "processor_config.json").is_file() or (folder / "preprocessor_config.json").is_file():
        return Qwen3VLProcessor.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer, Qwen2VLImageProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    geometry = {k: v for k, v in QWEN3_VL_IMAGE_PROCESSOR.items() if k != "size"}
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**QWEN3_VL_IMAGE_PROCESSOR),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**geometry),
        chat_template=getattr(tokenizer, "chat_template", None),
    )
