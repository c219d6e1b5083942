"""Read a LoRA safetensors file into `LoraFile`: every adapted layer of our transformer with its low-rank factors
(or full difference) and its alpha / rank scale, checked against the model before anything is merged.

Refused with a clear error: a pickle or any non-safetensors file (checkpoints/files.py), a full model instead of a
LoRA, adapter kinds that are not W + B @ A (LoHa, LoKr, DoRA, ...), layer names that match nothing in Qwen-Image-2.1
(a LoRA for another model must not load and do nothing), text-encoder parts, and factors whose shapes do not fit.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints.files import Checkpoint, CheckpointError, describe
from ..errors import stable_name
from . import keys
from .patterns import LayerPatterns, PatternError

log = logging.getLogger(__name__)

_SHOWN = 8  # how many names an error message lists
_METADATA_KEY = "lora_adapter_metadata"  # where diffusers / PEFT keep r, lora_alpha, alpha_pattern, ...
_PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig's default, which diffusers uses when the metadata omits lora_alpha
# A LoRA's header (its tensor list and the trainer's metadata) is far under this; parsing a 100 MiB one (what
# safetensors allows) holds Python, and ComfyUI's server with it, for seconds.
LORA_HEADER_LIMIT = 16 * 2**20


@stable_name
class LoraError(ValueError):
    """A LoRA file that cannot be applied to this model (wrong model, unknown keys, bad shapes, unsupported kind)."""


@dataclass(frozen=True)
class LoraLayer:
    """One adapted layer: delta = scale * up @ down, or the full `diff`. Tensors stay as stored, on the CPU."""

    layer: str  # our layer name (keys.py), e.g. "transformer_blocks.3.attn.to_q"
    up: torch.Tensor | None  # B [out, rank]
    down: torch.Tensor | None  # A [rank, in]
    diff: torch.Tensor | None  # a full difference of the weight's shape (ComfyUI `.diff`)
    scale: float  # alpha / rank (1 without an alpha)

    @property
    def rank(self) -> int:
        return 0 if self.down is None else self.down.shape[0]


@dataclass(frozen=True)
class LoraFile:
    path: Path
    layers: tuple[LoraLayer, ...]
    format: str  # e.g. "kohya (lora_unet_), ComfyUI-style lora_up/lora_down"
    identity: str  # what the file was when it was read (path, size, mtime): names it in merged-weight ids
    # On quantised weights: False merges it into them (requantised, no per-step cost), True keeps it beside them as
    # an exact low-rank side path (lora/merge.py); float weights merge either way.
    side_path: bool = False

    @property
    def nbytes(self) -> int:
        tensors = [t for layer in self.layers for t in (layer.up, layer.down, layer.diff) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        mode = ", side path" if self.side_path else ""
        return f"LoraFile({self.path.name}, {len(self.layers)} layers, {self.format}{mode})"


def read_lora(path: str | os.PathLike, layer_shapes: Mapping[str, tuple[int, ...]]) -> LoraFile:
    """Open and check a LoRA file against our layers (name -> weight shape, from merge.lora_layers)."""
    path = Path(path)
    stat = path.stat() if path.is_file() else None
    try:
        ckpt = Checkpoint.open(path, header_limit=LORA_HEADER_LIMIT)
    except CheckpointError as error:
        raise LoraError(f"LoRA {path.name}: {error}") from error
    with ckpt:
        groups, formats = _group(ckpt)
        layers = _layers(ckpt, groups, layer_shapes, _peft_alphas(ckpt.metadata, path.name))
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}" if stat else str(path.resolve())
    lora = LoraFile(path, tuple(layers), ", ".join(sorted(formats)), identity)
    log.info("read %r (%.1f MB)", lora, lora.nbytes / 1e6)
    return lora


def _group(ckpt: Checkpoint) -> tuple[dict[str, dict[str, str]], set[str]]:
    """stem -> {role: key}; refuses unsupported adapter kinds and files that are not LoRAs."""
    name = ckpt.path.name
    kinds = defaultdict(list)
    for key in ckpt.keys():
        kind = keys.unsupported_kind(key)
        if kind:
            kinds[kind].append(key)
    if kinds:
        listed = "; ".join(f"{kind} (e.g. {found[0]})" for kind, found in kinds.items())
        raise LoraError(f"LoRA {name}: uses {listed}, which qwen21-nodes cannot apply. Supported: plain LoRA "
                        "(low-rank up/down factors with an optional alpha) and full differences (.diff).")  # fmt: skip
    groups: dict[str, dict[str, str]] = defaultdict(dict)
    strays = []
    for key in ckpt.keys():
        split = keys.split_key(key)
        if split is None:
            strays.append(key)
            continue
        stem, role = split
        if role in groups[stem]:
            raise LoraError(f"LoRA {name}: layer {stem} has two {role} tensors ({groups[stem][role]} and {key})")
        groups[stem][role] = key
    if not any(set(roles) & {"up", "down", "diff"} for roles in groups.values()):
        found = describe(ckpt)
        what = f"is {found}" if found else f"has no LoRA tensors (first keys: {ckpt.keys()[: _SHOWN // 2]})"
        raise LoraError(f"{name}: not a LoRA file: it {what}. Pick a LoRA from the loras folder.")
    if strays:
        raise LoraError(f"LoRA {name}: {_listing('keys of no known LoRA format', strays)}")
    return groups, {_format_of(stem, roles) for stem, roles in groups.items()}


def _format_of(stem: str, roles: dict[str, str]) -> str:
    key = roles.get("up") or roles.get("diff") or next(iter(roles.values()))
    if stem.startswith(keys.FLAT_PREFIXES):
        return "kohya (flattened names)"
    if ".lora_B" in key or ".lora_A" in key:
        return "diffusers/PEFT (lora_A/lora_B)"
    if stem.startswith("diffusion_model."):
        return "ComfyUI (diffusion_model.)"
    return "lora_up/lora_down" if "up" in roles else "full differences"


def _layers(ckpt, groups, layer_shapes, peft_alpha) -> list[LoraLayer]:
    name = ckpt.path.name
    names = keys.LayerNames(layer_shapes)
    text_encoder = sorted(stem for stem in groups if keys.is_text_encoder(stem))
    resolved = {stem: names.resolve(stem) for stem in groups if stem not in text_encoder}
    unmatched = sorted(stem for stem, layer in resolved.items() if layer is None)
    if text_encoder:
        raise LoraError(
            f"LoRA {name}: {_listing('text-encoder layers', text_encoder)}; qwen21-nodes applies LoRAs to the "
            "diffusion model only (Qwen-Image-2.1 LoRAs normally leave the text encoder alone)"
        )
    if unmatched:
        matched = len(resolved) - len(unmatched)
        raise LoraError(
            f"LoRA {name}: {_listing('layers that match nothing in the Qwen-Image-2.1 transformer', unmatched)} "
            f"({matched} of {len(resolved)} matched).{keys.foreign_model_hint(unmatched)}"
        )
    by_layer = defaultdict(list)
    for stem, layer in resolved.items():
        by_layer[layer].append(stem)
    twice = [f"{layer} (as {' and '.join(stems)})" for layer, stems in by_layer.items() if len(stems) > 1]
    if twice:
        raise LoraError(f"LoRA {name}: {_listing('layers named twice', twice)}")

    problems, layers = [], []
    for stem, layer in sorted(resolved.items(), key=lambda item: item[1]):
        roles = groups[stem]
        problem = _check_shapes(ckpt, stem, roles, layer, layer_shapes[layer])
        if problem:
            problems.append(problem)
            continue
        layers.append(_read_layer(ckpt, roles, layer, peft_alpha))
    if problems:
        raise LoraError(f"LoRA {name} does not fit this Qwen-Image-2.1 model: {_listing('problems', problems)}")
    return layers


def _check_shapes(ckpt, stem, roles, layer, weight_shape) -> str | None:
    """What is wrong with one layer's tensors, or None."""
    if "diff" in roles:
        if set(roles) - {"diff"}:
            return f"{stem}: a full difference mixed with low-rank factors ({sorted(roles)})"
        shape = ckpt.shape(roles["diff"])
        return None if shape == weight_shape else f"{layer}: difference {list(shape)} vs weight {list(weight_shape)}"
    if "up" not in roles or "down" not in roles:
        return f"{stem}: has {sorted(roles)} but needs both up and down factors"
    if len(weight_shape) != 2:
        return f"{layer}: a low-rank LoRA on a 1-D weight {list(weight_shape)}"
    up, down = ckpt.shape(roles["up"]), ckpt.shape(roles["down"])
    if len(up) != 2 or len(down) != 2 or up[1] != down[0]:
        return f"{layer}: up {list(up)} and down {list(down)} are not [out, rank] and [rank, in]"
    if (up[0], down[1]) != weight_shape:
        return f"{layer}: up {list(up)} @ down {list(down)} gives {[up[0], down[1]]}, weight is {list(weight_shape)}"
    if up[1] == 0:
        return f"{layer}: rank 0 (up {list(up)}, down {list(down)}): an empty LoRA layer"
    if "alpha" in roles and math.prod(ckpt.shape(roles["alpha"])) != 1:
        return f"{layer}: alpha has shape {list(ckpt.shape(roles['alpha']))}, expected one number"
    for key in roles.values():
        dtype = ckpt.dtype(key)
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            return f"{key}: dtype {dtype}, expected a floating-point tensor"
    return None


def _read_layer(ckpt, roles, layer, peft_alpha) -> LoraLayer:
    if "diff" in roles:
        return LoraLayer(layer, None, None, ckpt.read(roles["diff"]), 1.0)
    up, down = ckpt.read(roles["up"]), ckpt.read(roles["down"])
    rank = down.shape[0]
    if "alpha" in roles:
        alpha = float(ckpt.read(roles["alpha"]).float().reshape(()))
        if not (math.isfinite(alpha) and alpha >= 0):
            raise LoraError(f"LoRA {ckpt.path.name}: {roles['alpha']} is {alpha}, expected a finite alpha >= 0")
        scale = alpha / rank
    else:
        scale = peft_alpha(layer, rank)
    return LoraLayer(layer, up, down, None, scale)


def _peft_alphas(metadata: Mapping[str, str], name: str):
    """layer, rank -> alpha / rank from diffusers / PEFT adapter metadata; 1 when a file has none. Every number in
    it is checked here (a NaN, infinite or negative alpha, a rank that is not a positive integer: a LoraError naming
    the file and the key), and alpha_pattern keys are matched by patterns.py, never by `re`. rank_pattern only says
    what shapes PEFT would build: the factors' own shapes are the ranks used, so its keys are not matched."""
    raw = metadata.get(_METADATA_KEY)
    if not raw:
        return lambda layer, rank: 1.0
    where = f"LoRA {name}: metadata {_METADATA_KEY}"
    try:
        config = json.loads(raw)
    except (ValueError, RecursionError) as error:  # not JSON, a number of thousands of digits, deep nesting
        raise LoraError(f"{where} is not JSON this reader takes: {str(error)[:200]}") from error
    if not isinstance(config, dict):
        raise LoraError(f"{where} is a JSON {type(config).__name__}, expected an object")
    config = {k.removeprefix("transformer."): v for k, v in config.items()}
    if config.get("use_dora"):
        raise LoraError(f"{where} says use_dora: DoRA (weight-decomposed LoRA) cannot be applied")
    alpha = config.get("lora_alpha")
    default_alpha = _alpha(_PEFT_DEFAULT_ALPHA if alpha is None else alpha, f"{where}: 'lora_alpha'")
    if config.get("r") is not None:
        _rank(config["r"], f"{where}: 'r'")
    for field, check in (("alpha_pattern", _alpha), ("rank_pattern", _rank)):
        entries = config.get(field) or {}
        if not isinstance(entries, dict):
            raise LoraError(f"{where}: {field} is a {type(entries).__name__}, expected an object of layer -> number")
        for key, value in entries.items():
            check(value, f"{where}: {field}[{key!r}]")
    alphas = config.get("alpha_pattern") or {}
    try:
        patterns = LayerPatterns(alphas)
    except PatternError as error:
        raise LoraError(f"{where}: alpha_pattern: {error}") from error
    rslora = bool(config.get("use_rslora"))

    def scale(layer: str, rank: int) -> float:
        try:
            key = patterns.find(layer)
        except PatternError as error:
            raise LoraError(f"{where}: alpha_pattern: {error}") from error
        alpha = default_alpha if key is None else float(alphas[key])
        return alpha / (math.sqrt(rank) if rslora else rank)

    return scale


def _alpha(value, what: str) -> float:
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer beyond float range
        number = math.inf
    if not (math.isfinite(number) and number >= 0):
        raise LoraError(f"{what} is {str(value)[:40]}, expected a finite number >= 0")
    return number


def _rank(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoraError(f"{what} is {str(value)[:40]}, expected an integer >= 1")
    return value


def _listing(label: str, items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"{len(items)} {label}: {', '.join(items[:_SHOWN])}{more}"
