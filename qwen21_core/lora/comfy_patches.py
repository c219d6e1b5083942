"""ComfyUI's weight patches (what its LoRA loaders put on a MODEL) as a LoRA stack for our merge (merge.py), under the
same rules as a LoRA file read by reading.py: float factors of the right shapes, plain LoRA or full differences.

ComfyUI keeps, per weight name of the MODEL's state dict, a list of `(strength, patch, strength_model, offset,
function)`; `patch` is an adapter object (`.name`, `.weights`) in ComfyUI since 2025, a `(kind, weights)` tuple
before. A LoRA adapter's weights are `(up, down, alpha, mid, dora_scale, reshape)`, a difference's `(diff,)`.
Plain data in, plain data out: no ComfyUI import, so this runs (and is tested) without ComfyUI.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch

from .reading import LoraError, LoraFile, LoraLayer

MODEL_PREFIX = "diffusion_model."


def comfy_patches_as_stack(patches: Mapping, layers: Mapping, patches_uuid) -> list[tuple[LoraFile, float]]:
    """`patches` (ModelPatcher.patches: weight name -> entries) as (LoraFile, strength) pairs, one per strength;
    `layers`: our LoRA-addressable layers (merge.py lora_layers: name -> LayerSlot). What our merge cannot apply
    (LoHa, LoKr, DoRA, model merges, functions, biases) and factors that do not fit are refused by name."""
    groups: dict[float, list[LoraLayer]] = {}
    for key, entries in patches.items():
        name = key.removeprefix(MODEL_PREFIX).removesuffix(".weight")
        if name not in layers:
            raise LoraError(f"a ComfyUI patch names {key!r}, which is no weight of Qwen-Image-2.1's DiT (our merge "
                            "changes the linear layers' weights only, not biases or norms)")  # fmt: skip
        for strength, patch, strength_model, offset, function in entries:
            if strength_model != 1.0 or function is not None:
                raise LoraError(f"a ComfyUI patch on {key} scales the model's own weight or applies a function "
                                "(a model merge?): our merged weights take LoRAs and differences only")  # fmt: skip
            strength = float(strength)
            if not math.isfinite(strength):
                raise LoraError(f"a ComfyUI patch on {key} has strength {strength}")
            target = _target(name, offset, layers)
            groups.setdefault(strength, []).append(lora_layer(target, key, patch, layers[target].shape))
    return [(LoraFile(Path("ComfyUI LoRA patches"), tuple(group), "ComfyUI patches",
                      identity=f"comfyui-patches:{patches_uuid}:{strength}"), strength)
            for strength, group in groups.items()]  # fmt: skip


def _target(name: str, offset, layers: Mapping) -> str:
    """The layer a patch lands on: `name`, or for a patch on rows of a fused weight the layer those rows are."""
    if offset is None:
        return name
    dim, start, size = offset
    slot = layers[name]
    want = slice(slot.rows.start + start, slot.rows.start + start + size)
    if dim == 0:
        for other, candidate in layers.items():
            if candidate.param == slot.param and candidate.rows == want:
                return other
    raise LoraError(f"a ComfyUI patch on {name} covers {offset} (dim, start, size), which is no layer of ours")


def lora_layer(target: str, key: str, patch, shape: tuple[int, ...]) -> LoraLayer:
    """One patch as our LoraLayer, checked as reading.py checks a file's layer: float tensors, up [out, rank] and
    down [rank, in] giving the weight's shape (ComfyUI flattens conv-shaped factors the same way), a finite alpha."""
    kind, weights = _kind_and_weights(patch)
    if kind == "diff":
        diff = _float(weights[0] if weights else None, key, "difference")
        if tuple(diff.shape) != tuple(shape):
            raise LoraError(f"the difference patch on {key} is {list(diff.shape)}; the weight is {list(shape)}")
        return LoraLayer(target, None, None, diff, 1.0)
    if kind != "lora":
        raise LoraError(f"a ComfyUI patch on {key} is a {kind!r} adapter: our merge takes LoRA (B @ A) and full "
                        "differences only (LoHa, LoKr, GLoRA, OFT and DoRA are not supported)")  # fmt: skip
    if len(weights) < 3:
        raise LoraError(f"the LoRA patch on {key} has {len(weights)} parts, expected up, down and alpha")
    up, down, alpha, *rest = weights
    if any(part is not None for part in rest):
        raise LoraError(f"the LoRA patch on {key} has a mid weight, a DoRA scale or a reshape: not supported")
    up, down = _float(up, key, "up factor"), _float(down, key, "down factor")
    if up.dim() < 2 or down.dim() < 2:
        raise LoraError(f"the LoRA patch on {key} has up {list(up.shape)} and down {list(down.shape)}: factors are "
                        "[out, rank] and [rank, in]")  # fmt: skip
    up, down = up.flatten(1), down.flatten(1)
    rank = down.shape[0]
    if up.shape[1] != rank or rank == 0:
        raise LoraError(f"the LoRA patch on {key}: up {list(up.shape)} and down {list(down.shape)} do not share a "
                        "rank (up [out, rank], down [rank, in], rank >= 1)")  # fmt: skip
    if (up.shape[0], down.shape[1]) != tuple(shape):
        raise LoraError(f"the LoRA patch on {key}: up @ down gives {[up.shape[0], down.shape[1]]}; the weight is "
                        f"{list(shape)}")  # fmt: skip
    scale = 1.0 if alpha is None else _alpha(alpha, key) / rank
    return LoraLayer(target, up, down, None, scale)


def _float(tensor, key: str, what: str) -> torch.Tensor:
    """The same dtype rule as a LoRA file's (reading.py): ComfyUI would cast integer, boolean or complex factors."""
    if not isinstance(tensor, torch.Tensor):
        raise LoraError(f"the {what} of the patch on {key} is a {type(tensor).__name__}, expected a tensor")
    if not tensor.dtype.is_floating_point:
        raise LoraError(f"the {what} of the patch on {key} has dtype {tensor.dtype}, expected a floating-point "
                        "tensor")  # fmt: skip
    return tensor


def _alpha(alpha, key: str) -> float:
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() != 1 or alpha.is_complex():
            raise LoraError(f"the alpha of the patch on {key} is a tensor of shape {list(alpha.shape)}, expected one "
                            "number")  # fmt: skip
        alpha = alpha.item()
    try:
        value = float(alpha)
    except (TypeError, ValueError, OverflowError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise LoraError(f"the alpha of the patch on {key} is {str(alpha)[:40]}, expected a finite number >= 0")
    return value


def _kind_and_weights(patch) -> tuple[str, tuple]:
    """(kind, weights) of a patch in either form ComfyUI uses: an adapter object (`.name`, `.weights`) or a
    (kind, weights) tuple."""
    if hasattr(patch, "weights") and hasattr(patch, "name"):
        return patch.name, tuple(patch.weights)
    if isinstance(patch, tuple) and len(patch) == 2 and isinstance(patch[0], str):
        return patch[0], tuple(patch[1])
    return type(patch).__name__, ()
