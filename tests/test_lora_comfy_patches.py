"""ComfyUI's weight patches as our LoRA stack (qwen21_core/lora/comfy_patches.py), without ComfyUI: the same rules as a
LoRA file's (float factors of fitting shapes, a finite alpha), what our merge cannot apply refused by name, and the
scale alpha / rank carried."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from qwen21_nodes.qwen21_core.lora.comfy_patches import comfy_patches_as_stack
from qwen21_nodes.qwen21_core.lora.merge import LayerSlot
from qwen21_nodes.qwen21_core.lora.reading import LoraError

Q, K = "transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k"
QKV = "transformer_blocks.0.attn.to_qkv"
FUSED = "transformer_blocks.0.attn.to_qkv.weight"
LAYERS = {Q: LayerSlot(FUSED, slice(0, 8), (8, 6)), K: LayerSlot(FUSED, slice(8, 16), (8, 6)),
          QKV: LayerSlot(FUSED, slice(0, 24), (24, 6))}  # fmt: skip


def adapter(kind, *weights):
    return SimpleNamespace(name=kind, weights=weights)  # ComfyUI's adapter objects (comfy/weight_adapter)


def lora(rank=2, alpha=None, out=8, inp=6, dtype=torch.float32):
    return adapter("lora", torch.randn(out, rank).to(dtype), torch.randn(rank, inp).to(dtype), alpha, None, None, None)


def entry(patch, strength=1.0, offset=None):
    return (strength, patch, 1.0, offset, None)


def test_alpha_over_rank_is_the_scale_and_strengths_group_by_value():
    patches = {f"diffusion_model.{Q}.weight": [entry(lora(rank=4, alpha=3.0), 0.7), entry(lora(), 0.4)],
               f"diffusion_model.{K}.weight": [entry(lora(alpha=torch.tensor(1.0)), 0.7)]}  # fmt: skip
    stack = comfy_patches_as_stack(patches, LAYERS, "uuid")
    assert [strength for _, strength in stack] == [0.7, 0.4]
    first = {layer.layer: layer for layer in stack[0][0].layers}
    assert math.isclose(first[Q].scale, 3.0 / 4) and math.isclose(first[K].scale, 1.0 / 2)
    assert stack[1][0].layers[0].scale == 1.0  # no alpha: the factors as they are
    assert stack[0][0].identity != stack[1][0].identity  # each strength its own piece of the merged-weights id


def test_a_patch_on_rows_of_a_fused_weight_lands_on_the_layer_those_rows_are():
    patches = {f"diffusion_model.{QKV}.weight": [entry(lora(out=8), offset=(0, 8, 8))]}
    (piece, _), = comfy_patches_as_stack(patches, LAYERS, "uuid")
    assert piece.layers[0].layer == K
    with pytest.raises(LoraError, match="no layer of ours"):
        comfy_patches_as_stack({f"diffusion_model.{QKV}.weight": [entry(lora(out=8), offset=(0, 4, 8))]}, LAYERS, 0)


@pytest.mark.parametrize(
    "patch, message",
    [
        (lora(dtype=torch.int64), "dtype torch.int64, expected a floating-point"),
        (lora(dtype=torch.bool), "dtype torch.bool"),
        (adapter("lora", torch.randn(8, 2), torch.randn(3, 6), None, None, None, None), "do not share a rank"),
        (adapter("lora", torch.randn(8), torch.randn(6), None, None, None, None), "factors are \\[out, rank\\]"),
        (adapter("lora", torch.randn(8, 2), torch.randn(2, 5), None, None, None, None), "gives \\[8, 5\\]"),
        (adapter("lora", torch.randn(8, 0), torch.randn(0, 6), None, None, None, None), "rank >= 1"),
        (lora(alpha=float("nan")), "expected a finite number >= 0"),
        (lora(alpha=torch.ones(2)), "expected one"),
        (adapter("lora", torch.randn(8, 2), torch.randn(2, 6), None, torch.randn(2, 2), None, None), "mid weight"),
        (adapter("loha", torch.randn(8, 2)), "'loha' adapter"),
        (adapter("diff", torch.randn(8, 5)), "difference patch .* is \\[8, 5\\]"),
        (("lora", (torch.randn(8, 2), "down", None)), "down factor .* is a str"),
    ],
)
def test_what_our_merge_cannot_apply_is_named(patch, message):
    with pytest.raises(LoraError, match=message):
        comfy_patches_as_stack({f"diffusion_model.{Q}.weight": [entry(patch)]}, LAYERS, "uuid")


def test_model_merges_functions_and_unknown_weights_are_named():
    key = f"diffusion_model.{Q}.weight"
    with pytest.raises(LoraError, match="model merge"):
        comfy_patches_as_stack({key: [(1.0, lora(), 0.5, None, None)]}, LAYERS, 0)
    with pytest.raises(LoraError, match="model merge"):
        comfy_patches_as_stack({key: [(1.0, lora(), 1.0, None, abs)]}, LAYERS, 0)
    with pytest.raises(LoraError, match="no weight of Qwen-Image-2.1"):
        comfy_patches_as_stack({"diffusion_model.norm_out.linear.bias": [entry(lora())]}, LAYERS, 0)
    with pytest.raises(LoraError, match="strength inf"):
        comfy_patches_as_stack({key: [entry(lora(), float("inf"))]}, LAYERS, 0)
