"""Weight quantisation formats found in checkpoints: what we accept, what we refuse, how each weight is stored.

Accepted (per weight, so mixed files with some layers in bf16 work):
- plain bf16 / fp16 / fp32 weights;
- fp8 (float8_e4m3fn, float8_e5m2), unscaled or with ComfyUI scales ("fp8_scaled" files), both generations
  (comfy/utils.py `convert_old_quants`, comfy/quant_ops.py):
    old "scaled fp8":  a marker tensor `scaled_fp8`, `<layer>.scale_weight` (fp32) and optional `.scale_input`;
    new mixed ops:     `<layer>.comfy_quant` (uint8 bytes of a JSON dict {"format": ...}) or the same dicts in the
                       safetensors metadata `_quantization_metadata` {"layers": {layer: {...}}}, with
                       `<layer>.weight_scale` and optional `<layer>.input_scale`;
- int8, ComfyUI format "int8_tensorwise": `<layer>.weight` int8 [N, K], `<layer>.weight_scale` fp32 [N, 1] (per
  row) or a scalar, and in the marker `"convrot": true, "convrot_groupsize": 256` (flat, or nested under
  "params") when the stored weight is Hadamard-rotated (the int8_convrot files of Comfy-Org's Qwen-Image-2.1
  release use 256; any group comfy-kitchen can write, the powers of 4 from 4 to 1024, loads; see
  quant/weights.py).
In every case weight = q.float() * scale (rotated back for ConvRot). Input scales (static fp8 activation scales)
are dropped: activations are quantised per row at run time. Everything else (NVFP4, MXFP8, W4A4/W4A8, AWQ,
GPTQ, GGUF, bitsandbytes, ...) raises `UnsupportedQuantizationError` naming the format and what to use instead.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import stable_name
from ..quant.weights import ROTATION_GROUPS, QuantFormat, dequantize_weight

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED = (
    "bf16, fp16 and fp32 weights; fp8 weights (float8_e4m3fn, float8_e5m2) unscaled or with ComfyUI scales "
    "(fp8_scaled files); int8 weights in ComfyUI's int8_tensorwise format, with or without ConvRot rotation "
    "(int8_convrot files)"
)
INSTEAD = "Use the bf16, fp8_scaled or int8_convrot release of the file instead."

_FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
_INT8_FORMAT = "int8_tensorwise"
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
        super().__init__(f"{path}: uses {what}, which qwen21-nodes cannot load. Supported: {SUPPORTED}. {INSTEAD}")


@dataclass(frozen=True)
class StoredLayer:
    """How one weight is stored: its dtype, scale tensor key (None = unscaled) and ConvRot group (0 = none)."""

    dtype: torch.dtype
    scale_key: str | None = None
    rotation: int = 0

    @property
    def fmt(self) -> QuantFormat | None:
        """The matching in-memory QuantFormat (None for fp8 e5m2, which the GEMMs do not take as it is)."""
        if self.dtype == torch.int8:
            return QuantFormat("int8", self.rotation)
        return QuantFormat("fp8") if self.dtype == torch.float8_e4m3fn else None


@dataclass(frozen=True)
class QuantScheme:
    """How the weights of one checkpoint are stored.

    layers:     weight key -> StoredLayer, for every quantised (fp8/int8) weight.
    auxiliary:  keys that are not weights (scales, input scales, format markers); the loader skips them.
    name:       short description for logs and the UI, e.g. "int8 ConvRot, per-row scales".
    """

    layers: Mapping[str, StoredLayer] = field(default_factory=dict)
    auxiliary: frozenset[str] = frozenset()
    name: str = ""

    @property
    def quantized(self) -> bool:
        return bool(self.layers)

    def formats(self) -> set[str]:
        """In-memory format names of the quantised weights ("fp8", "int8", "int8_convrot"; e5m2 counts as fp8)."""
        return {layer.fmt.name if layer.fmt else "fp8" for layer in self.layers.values()}


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
    # ComfyUI's own format names first: they say more than the raw dtypes (NVFP4, W4A8, ...).
    markers = _comfy_layer_markers(path, keys, metadata, read)
    unsupported = sorted({m.get("format", "?") for m in markers.values()} - set(_FP8_FORMATS) - {_INT8_FORMAT})
    if unsupported:
        count = sum(m.get("format", "?") in unsupported for m in markers.values())
        raise UnsupportedQuantizationError(path, f"ComfyUI quantisation format {unsupported} on {count} layers")
    _reject_foreign(path, keys, dtype_of, metadata)

    auxiliary = {k for k in keys if k.endswith((".comfy_quant", ".input_scale", ".scale_input"))}
    auxiliary |= {k for k in keys if k == "scaled_fp8" or k.endswith(".scaled_fp8")}
    layers = {}
    for key in keys:
        if not key.endswith(".weight"):
            continue
        layer = key[: -len(".weight")]
        dtype = dtype_of(key)
        scale_key = next((s for s in (f"{layer}.weight_scale", f"{layer}.scale_weight") if s in key_set), None)
        if scale_key is not None:
            auxiliary.add(scale_key)
        if dtype in FP8_DTYPES:
            layers[key] = StoredLayer(dtype, scale_key)
        elif dtype == torch.int8:
            layers[key] = _int8_layer(path, key, scale_key, markers.get(layer))
        elif scale_key is not None:
            raise UnsupportedQuantizationError(path, f"a dequantisation scale on a {dtype} weight ({key})")
    stray = sorted(k for k in keys if k.endswith((".weight_scale", ".scale_weight")) and k not in auxiliary)
    if stray:
        raise UnsupportedQuantizationError(path, f"scale tensors without a matching weight (e.g. {stray[:3]})")
    weights = [k for k in keys if k not in auxiliary]
    return QuantScheme(layers=layers, auxiliary=frozenset(auxiliary), name=_describe(weights, dtype_of, layers))


def _int8_layer(path: str, key: str, scale_key: str | None, marker: dict | None) -> StoredLayer:
    if marker is None or marker.get("format") != _INT8_FORMAT:
        raise UnsupportedQuantizationError(
            path, f"int8 weights without a ComfyUI int8_tensorwise marker (e.g. {key}), an unknown integer format"
        )
    if scale_key is None:
        raise UnsupportedQuantizationError(path, f"int8 weight {key} without its weight_scale")
    params = marker.get("params") if isinstance(marker.get("params"), dict) else {}
    convrot = marker.get("convrot", params.get("convrot", False))
    try:
        group = int(marker.get("convrot_groupsize", params.get("convrot_groupsize", 256))) if convrot else 0
    except (TypeError, ValueError, OverflowError):
        size = marker.get("convrot_groupsize", params.get("convrot_groupsize"))
        raise _malformed(path, key, f"convrot_groupsize {size!r:.40} is not a number") from None
    if group not in (0, *ROTATION_GROUPS):
        supported = ", ".join(map(str, ROTATION_GROUPS))
        raise UnsupportedQuantizationError(
            path,
            f"ConvRot with group size {group} on {key} (supported: {supported}; comfy-kitchen's rotation is "
            "defined for powers of 4 only)",
        )
    return StoredLayer(torch.int8, scale_key, group)


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None, rotation: int = 0) -> torch.Tensor:
    """A stored quantised weight (and its scale, if any) -> float32 weight, on the weight's device.

    The scale is a scalar (per tensor) or one value per output row ([N] or [N, 1]), as ComfyUI and ModelOpt
    store them; ConvRot weights are rotated back.
    """
    if scale is None:
        return weight.to(torch.float32)
    scale = scale.to(device=weight.device, dtype=torch.float32)
    if scale.numel() not in (1, weight.shape[0]):
        raise ValueError(
            f"weight scale of shape {tuple(scale.shape)} does not fit a weight of shape {tuple(weight.shape)}: "
            "expected one value per tensor or one per output row (block-scaled formats such as MXFP8 are not supported)"
        )
    if weight.dim() != 2:
        return weight.to(torch.float32).mul_(scale.reshape(-1, *([1] * (weight.dim() - 1))))
    return dequantize_weight(weight, scale, rotation, torch.float32)


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
        if dtype == torch.int8 and key.endswith(".weight"):
            continue  # judged per layer, by its marker
        if not (dtype.is_floating_point or dtype == torch.bool):
            raise UnsupportedQuantizationError(path, f"{dtype} weights (e.g. {key}), an integer-quantised format")


def _comfy_layer_markers(path, keys, metadata, read) -> dict[str, dict]:
    """layer -> ComfyUI marker dict ({"format": ..., ...}), from `.comfy_quant` tensors and `_quantization_metadata`.
    Markers come from the file: anything but JSON objects with a string format is a checkpoint error."""
    markers = {}
    if "_quantization_metadata" in metadata:
        where = "metadata _quantization_metadata"
        config = _json(path, metadata["_quantization_metadata"], where)
        layers = config.get("layers", {}) if isinstance(config, dict) else None
        if not isinstance(layers, dict):
            raise _malformed(path, where, "expected an object with 'layers': {layer: marker}")
        for layer, conf in layers.items():
            markers[layer] = _marker(path, conf, f"{where}, layer {layer}")
    for key in keys:
        if key.endswith(".comfy_quant"):
            tensor = read(key)
            if tensor.dtype != torch.uint8 or tensor.dim() != 1:
                raise _malformed(path, key, f"a {tensor.dtype} tensor of shape {list(tensor.shape)}, not uint8 bytes")
            try:
                text = bytes(tensor.tolist()).decode("utf-8")
            except UnicodeDecodeError as error:
                raise _malformed(path, key, f"not UTF-8 ({error})") from None
            markers[key[: -len(".comfy_quant")]] = _marker(path, _json(path, text, key), key)
    return markers


def _json(path, text: str, where: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        raise _malformed(path, where, f"not JSON ({error})") from None


def _marker(path, conf, where: str) -> dict:
    marker = conf if isinstance(conf, dict) else {"format": str(conf)}
    if not isinstance(marker.get("format", "?"), str):
        raise _malformed(path, where, f"its format is {marker['format']!r:.80}, not a name")
    return marker


def _malformed(path, where: str, what: str) -> ValueError:
    from .files import CheckpointError  # files.py imports this module: the error class is fetched when needed

    return CheckpointError(f"{path}: malformed ComfyUI quantisation marker in {where}: {what}")


def _describe(keys, dtype_of, layers: Mapping[str, StoredLayer]) -> str:
    if not layers:
        floats = sorted({str(dtype_of(k)).removeprefix("torch.") for k in keys})
        return "/".join(floats)
    parts = []
    int8 = [layer for layer in layers.values() if layer.dtype == torch.int8]
    if int8:
        rotated = sum(layer.rotation > 0 for layer in int8)
        kind = "int8 ConvRot" if rotated == len(int8) else "int8" if not rotated else "int8 (partly ConvRot)"
        parts.append(kind)
    fp8 = sorted(
        {str(layer.dtype).removeprefix("torch.float8_") for layer in layers.values() if layer.dtype != torch.int8}
    )
    if fp8:
        parts.append("fp8 " + "/".join(fp8))
    scaled = any(layer.scale_key for layer in layers.values())
    return ", ".join(parts) + (", scaled" if scaled else ", unscaled")
