"""Weight quantisation formats found in checkpoints: what we accept, what we refuse, how to dequantise.

Accepted: plain bf16 / fp16 / fp32 weights, and fp8 (float8_e4m3fn, float8_e5m2) weights with or without a
per-tensor scale as ComfyUI's fp8 files store them. Everything is upcast when loaded (`dequantize`); running
the matmuls in FP8 later only needs the (weight, scale) pairs this module already identifies.

ComfyUI stores fp8 scales in two generations of files (comfy/utils.py `convert_old_quants`, comfy/quant_ops.py):
  old "scaled fp8":  a marker tensor `scaled_fp8` (its dtype names the fp8 format), `<layer>.scale_weight`
                     (fp32 scalar) and optional `<layer>.scale_input`;
  new mixed ops:     `<layer>.comfy_quant` (uint8 bytes of a JSON dict {"format": ...}) or the same dicts in the
                     safetensors metadata `_quantization_metadata` {"layers": {layer: {...}}}, with
                     `<layer>.weight_scale` and optional `<layer>.input_scale`.
Either way the real weight is `fp8_weight.float() * scale`. Input scales only matter for fp8 activations and
are dropped. Other formats (int8 ConvRot, NVFP4, MXFP8, AWQ, GGUF, bitsandbytes, ...) raise
`UnsupportedQuantizationError` naming the format.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import stable_name

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED = (
    "bf16, fp16 and fp32 weights; fp8 weights (float8_e4m3fn, float8_e5m2) with or without ComfyUI per-tensor "
    "scales (fp8_scaled files)"
)

# ComfyUI format names (comfy/quant_ops.py QUANT_ALGOS) we can dequantise.
_FP8_FORMATS = {"float8_e4m3fn", "float8_e5m2"}
# Key suffixes of quantisation schemes we do not support, and what to call them.
_FOREIGN_SUFFIXES = {
    ".qweight": "GPTQ/AWQ 4-bit",
    ".qzeros": "GPTQ/AWQ 4-bit",
    ".weight_scale_2": "NVFP4",
    ".pre_quant_scale": "NVFP4/AWQ",
    ".absmax": "bitsandbytes",
    ".quant_map": "bitsandbytes",
    ".SCB": "bitsandbytes int8",
}


@stable_name
class UnsupportedQuantizationError(ValueError):
    """The checkpoint uses a quantisation format this pack cannot load."""

    def __init__(self, path: str, what: str):
        super().__init__(
            f"{path}: uses {what}, which qwen21-nodes cannot load. Supported: {SUPPORTED}. "
            "Use the bf16 or fp8_scaled release of the file instead."
        )


@dataclass(frozen=True)
class QuantScheme:
    """How the weights of one checkpoint are stored.

    scales:     weight key -> key of its dequantisation scale (fp8 scaled files only).
    auxiliary:  keys that are not weights (scales, input scales, format markers); the loader skips them.
    name:       short description for logs and the UI, e.g. "fp8 e4m3fn, ComfyUI per-tensor scales".
    """

    scales: Mapping[str, str] = field(default_factory=dict)
    auxiliary: frozenset[str] = frozenset()
    name: str = ""


def inspect(
    path: str,
    keys: Iterable[str],
    dtype_of: Callable[[str], torch.dtype | str],
    metadata: Mapping[str, str],
    read: Callable[[str], torch.Tensor],
) -> QuantScheme:
    """Identify the storage format of a checkpoint from its keys, dtypes and metadata.

    `dtype_of(key)` returns the torch dtype, or the safetensors dtype string when torch has none for it;
    `read(key)` reads one (small) tensor, used for the `.comfy_quant` markers.
    """
    keys = list(keys)
    key_set = set(keys)
    # ComfyUI's own format names first: they say more than the raw dtypes (int8 ConvRot, NVFP4, ...).
    layer_formats = _comfy_layer_formats(keys, metadata, read)
    unsupported = sorted({fmt for fmt in layer_formats.values() if fmt not in _FP8_FORMATS})
    if unsupported:
        count = sum(fmt not in _FP8_FORMATS for fmt in layer_formats.values())
        raise UnsupportedQuantizationError(path, f"ComfyUI quantisation format {unsupported} on {count} layers")
    _reject_foreign(path, keys, dtype_of, metadata)

    auxiliary = {k for k in keys if k.endswith((".comfy_quant", ".input_scale", ".scale_input"))}
    auxiliary |= {k for k in keys if k == "scaled_fp8" or k.endswith(".scaled_fp8")}
    scales = {}
    for key in keys:
        if not key.endswith(".weight"):
            continue
        layer = key[: -len(".weight")]
        for scale_key in (f"{layer}.weight_scale", f"{layer}.scale_weight"):
            if scale_key in key_set:
                scales[key] = scale_key
                auxiliary.add(scale_key)
    stray = sorted(k for k in keys if k.endswith((".weight_scale", ".scale_weight")) and k not in auxiliary)
    if stray:
        raise UnsupportedQuantizationError(path, f"scale tensors without a matching weight (e.g. {stray[:3]})")

    for weight_key in scales:
        if dtype_of(weight_key) not in FP8_DTYPES:
            raise UnsupportedQuantizationError(
                path, f"a dequantisation scale on a {dtype_of(weight_key)} weight ({weight_key})"
            )
    weights = [k for k in keys if k not in auxiliary]
    return QuantScheme(scales=scales, auxiliary=frozenset(auxiliary), name=_describe(weights, dtype_of, scales))


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp8 weight (and its scale, if any) -> float32 weight, on the weight's device.

    The scale is a scalar (per tensor) or one value per output row, as ComfyUI and ModelOpt store them.
    """
    out = weight.to(torch.float32)
    if scale is None:
        return out
    scale = scale.to(device=out.device, dtype=torch.float32)
    if scale.numel() == 1:
        return out.mul_(scale.reshape(()))
    if scale.numel() == out.shape[0]:
        return out.mul_(scale.reshape(-1, *([1] * (out.dim() - 1))))
    raise ValueError(
        f"fp8 weight scale of shape {tuple(scale.shape)} does not fit a weight of shape {tuple(weight.shape)}: "
        "expected one value per tensor or one per output row (block-scaled formats such as MXFP8 are not supported)"
    )


def _reject_foreign(path, keys, dtype_of, metadata) -> None:
    if any(name.startswith("comfy.gguf") for name in metadata):
        raise UnsupportedQuantizationError(path, "GGUF quantisation stored in safetensors (ComfyUI-GGUF)")
    for key in keys:
        for suffix, what in _FOREIGN_SUFFIXES.items():
            if key.endswith(suffix):
                raise UnsupportedQuantizationError(path, f"{what} quantisation (key {key})")
    for key in keys:
        if key.endswith((".comfy_quant", "scaled_fp8")):
            continue
        dtype = dtype_of(key)
        if isinstance(dtype, str):
            raise UnsupportedQuantizationError(path, f"tensors of dtype {dtype} (e.g. {key}), a packed low-bit format")
        if not (dtype.is_floating_point or dtype == torch.bool):
            raise UnsupportedQuantizationError(path, f"{dtype} weights (e.g. {key}), an integer-quantised format")


def _comfy_layer_formats(keys, metadata, read) -> dict[str, str]:
    """layer -> ComfyUI format name, from `.comfy_quant` markers and `_quantization_metadata`."""
    formats = {}
    if "_quantization_metadata" in metadata:
        layers = json.loads(metadata["_quantization_metadata"]).get("layers", {})
        for layer, conf in layers.items():
            formats[layer] = conf.get("format", "?") if isinstance(conf, dict) else str(conf)
    for key in keys:
        if key.endswith(".comfy_quant"):
            conf = json.loads(bytes(read(key).tolist()).decode("utf-8"))
            formats[key[: -len(".comfy_quant")]] = conf.get("format", "?")
    return formats


def _describe(keys, dtype_of, scales) -> str:
    fp8 = sorted({str(dtype_of(k)).removeprefix("torch.") for k in keys if dtype_of(k) in FP8_DTYPES})
    if not fp8:
        floats = sorted({str(dtype_of(k)).removeprefix("torch.") for k in keys})
        return "/".join(floats)
    kind = "fp8 " + "/".join(name.removeprefix("float8_") for name in fp8)
    return kind + (", per-tensor scales" if scales else ", unscaled")
