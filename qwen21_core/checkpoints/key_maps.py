"""Key maps between checkpoint layouts and the diffusers names our modules use, in both directions.

Loading uses converters: `convert(key, tensor) -> [(diffusers_key, tensor), ...]`, where the tensors are views
of the input (a split, a dropped unit axis), so no copy is made. The inverse maps turn a diffusers-named state
dict into the other layouts; make-tiny writes ComfyUI files with them and the tests check the round trips.

Layouts (facts from ComfyUI's source: comfy/ldm/wan/vae2_2.py, comfy/sd.py, comfy/text_encoders/llama.py):
- transformer, ComfyUI: the diffusers names behind `model.diffusion_model.`, with the SwiGLU gate and up
  projections fused into `img_mlp.gate_up.weight` (2*M, D), gate rows first.
- VAE, ComfyUI: the original Wan 2.2 module tree (`encoder.conv1`, `downsamples.i.downsamples.j.residual.k`,
  `middle.0..2`, `head.0/2`, top-level `conv1`/`conv2`) with 5-D causal-conv weights (out, in, 1, kh, kw);
  the plain 2-D convs (resample, attention) are 4-D as in diffusers.
- text encoder: Comfy-Org ships Qwen3-VL-8B with the Hugging Face transformers names (`model.language_model.`,
  `model.visual.`, `lm_head.`); ComfyUI renames them for its own module to `model.`, `visual.` and
  `model.lm_head.` ("comfyui-internal"), which is what a file saved from inside ComfyUI holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from .files import Converter, Layout

COMFY_DIT_PREFIX = "model.diffusion_model."


def converter(layout: Layout, keys: Iterable[str]) -> Converter:
    """The converter that turns `layout`'s keys (all of `keys`, the checkpoint's) into diffusers names."""
    if layout.component in ("transformer", "control"):  # the control branch's blocks are named as the DiT's
        return _dit_converter(layout.prefix)
    if layout.component == "vae":
        if layout.name == "diffusers":
            return _identity
        return _comfy_vae_converter(vae_num_res_blocks(keys, layout.name))
    if layout.name == "comfyui-internal":
        return lambda key, tensor: [(te_internal_to_transformers(key), tensor)]
    return _identity


def _identity(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(key, tensor)]


# ---------------------------------------------------------------------------------------------------------
# Transformer
# ---------------------------------------------------------------------------------------------------------

_GATE_UP = "img_mlp.gate_up.weight"
_GATE, _UP = "img_mlp.gate_layer.weight", "img_mlp.proj.weight"


def _dit_converter(prefix: str) -> Converter:
    def convert(key, tensor):
        name = key.removeprefix(prefix)
        if name.endswith(_GATE_UP):
            stem = name[: -len(_GATE_UP)]
            gate, up = tensor.chunk(2, dim=0)  # gate rows first
            return [(stem + _GATE, gate), (stem + _UP, up)]
        return [(name, tensor)]

    return convert


def dit_to_comfyui(state_dict: Mapping[str, torch.Tensor], prefix: str = COMFY_DIT_PREFIX) -> dict[str, torch.Tensor]:
    """Diffusers transformer state dict -> ComfyUI single-file layout (prefix, fused gate_up)."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith(_UP):
            continue  # written with its gate
        if name.endswith(_GATE):
            stem = name[: -len(_GATE)]
            out[prefix + stem + _GATE_UP] = torch.cat([tensor, state_dict[stem + _UP]], dim=0)
        else:
            out[prefix + name] = tensor
    return out


# ---------------------------------------------------------------------------------------------------------
# VAE
# ---------------------------------------------------------------------------------------------------------

# Inside a residual block: Wan's nn.Sequential indices -> diffusers names.
_RESNET_PARTS = (
    ("residual.0.", "norm1."),
    ("residual.2.", "conv1."),
    ("residual.3.", "norm2."),
    ("residual.6.", "conv2."),
    ("shortcut.", "conv_shortcut."),
)
# Encoder/decoder stems, Wan -> diffusers.
_VAE_STEMS = (
    ("conv1.", "conv_in."),
    ("head.0.", "norm_out."),
    ("head.2.", "conv_out."),
    ("middle.0.", "mid_block.resnets.0."),
    ("middle.1.", "mid_block.attentions.0."),
    ("middle.2.", "mid_block.resnets.1."),
)
_VAE_TOP = (("conv1.", "quant_conv."), ("conv2.", "post_quant_conv."))
# Weights of plain 2-D convs, 4-D in both layouts; every other conv weight is a 5-D causal conv in Wan's.
_VAE_2D_WEIGHTS = ("resample.1.weight", "to_qkv.weight", "proj.weight")
_WAN_STAGE = re.compile(r"(downsamples|upsamples)\.(\d+)\.\1\.(\d+)\.(.*)")
_DIFFUSERS_STAGE = re.compile(r"(down_blocks|up_blocks)\.(\d+)\.(?:resnets\.(\d+)|downsampler|upsampler)\.(.*)")


def vae_num_res_blocks(keys: Iterable[str], layout_name: str) -> int:
    """Residual blocks per encoder stage (the decoder has one more), counted in encoder stage 0."""
    pattern = (
        r"encoder\.down_blocks\.0\.resnets\.(\d+)\."
        if layout_name == "diffusers"
        else r"encoder\.downsamples\.0\.downsamples\.(\d+)\.residual\."
    )
    found = {int(m.group(1)) for key in keys if (m := re.match(pattern, key))}
    if not found:
        raise ValueError(f"VAE checkpoint ({layout_name} layout) has no residual blocks in encoder stage 0")
    return max(found) + 1


def vae_key_to_diffusers(key: str, num_res_blocks: int) -> str:
    """One ComfyUI (Wan 2.2) VAE key -> its diffusers name; unknown keys come back unchanged."""
    for old, new in _VAE_TOP:
        if key.startswith(old):
            return new + key[len(old) :]
    side, _, rest = key.partition(".")
    if side not in ("encoder", "decoder"):
        return key
    for old, new in _VAE_STEMS:
        if rest.startswith(old):
            return _rename_resnet(f"{side}.{new}{rest[len(old) :]}")
    match = _WAN_STAGE.fullmatch(rest)
    if match is None:
        return key
    _, stage, index, tail = match.groups()
    blocks, sampler = ("down_blocks", "downsampler") if side == "encoder" else ("up_blocks", "upsampler")
    resnets = num_res_blocks if side == "encoder" else num_res_blocks + 1
    inner = f"resnets.{index}" if int(index) < resnets else sampler
    return _rename_resnet(f"{side}.{blocks}.{stage}.{inner}.{tail}")


def vae_key_to_comfyui(name: str, num_res_blocks: int) -> str:
    """One diffusers VAE key -> its ComfyUI (Wan 2.2) name; the inverse of `vae_key_to_diffusers`."""
    for new, old in _VAE_TOP:
        if name.startswith(old):
            return new + name[len(old) :]
    side, _, rest = name.partition(".")
    for new, old in reversed(_RESNET_PARTS):
        rest = rest.replace("." + old, "." + new, 1) if ".resnets." in rest else rest
    for new, old in _VAE_STEMS:
        if rest.startswith(old):
            return f"{side}.{new}{rest[len(old) :]}"
    match = _DIFFUSERS_STAGE.fullmatch(rest)
    if match is None:
        return name
    blocks, stage, index, tail = match.groups()
    wan = "downsamples" if blocks == "down_blocks" else "upsamples"
    if index is None:  # the sampler follows the residual blocks
        index = num_res_blocks if side == "encoder" else num_res_blocks + 1
    return f"{side}.{wan}.{stage}.{wan}.{index}.{tail}"


def _rename_resnet(name: str) -> str:
    for old, new in _RESNET_PARTS:
        name = name.replace("." + old, "." + new, 1)
    return name


def _comfy_vae_converter(num_res_blocks: int) -> Converter:
    def convert(key, tensor):
        if tensor.dim() == 5 and tensor.shape[2] == 1:
            tensor = tensor[:, :, 0]  # causal conv with temporal kernel 1 == 2-D conv
        return [(vae_key_to_diffusers(key, num_res_blocks), tensor)]

    return convert


def vae_to_comfyui(state_dict: Mapping[str, torch.Tensor], num_res_blocks: int) -> dict[str, torch.Tensor]:
    """Diffusers VAE state dict -> ComfyUI (Wan 2.2) layout with 5-D causal-conv weights."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith(".weight") and tensor.dim() == 4 and not name.endswith(_VAE_2D_WEIGHTS):
            tensor = tensor.unsqueeze(2)
        out[vae_key_to_comfyui(name, num_res_blocks)] = tensor
    return out


# ---------------------------------------------------------------------------------------------------------
# Text encoder
# ---------------------------------------------------------------------------------------------------------

# ComfyUI's module names -> transformers' Qwen3VLForConditionalGeneration names; first match wins.
_TE_INTERNAL = (
    ("model.lm_head.", "lm_head."),
    ("model.", "model.language_model."),
    ("visual.", "model.visual."),
)


def te_internal_to_transformers(key: str) -> str:
    for old, new in _TE_INTERNAL:
        if key.startswith(old):
            return new + key[len(old) :]
    return key


def te_transformers_to_internal(name: str) -> str:
    for old, new in _TE_INTERNAL:
        if name.startswith(new):
            return old + name[len(new) :]
    return name
