"""Quantised checkpoint files written the way Comfy-Org's are, for the loader tests.

ComfyUI's mixed-precision ops read, per quantised Linear `<layer>`:
  <layer>.weight        int8 [N, K] (int8_tensorwise) or float8_e4m3fn [N, K]
  <layer>.weight_scale  fp32 [N, 1] (per row) or a scalar
  <layer>.comfy_quant   uint8 bytes of JSON: {"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": G}
                        (ConvRot only where K is a multiple of G, as ComfyUI's converter does; G is 256 in the
                        released files, any power of 4 comfy-kitchen accepts otherwise) or
                        {"format": "float8_e4m3fn"}
int8 ConvRot weights are stored rotated: W_rot = W @ H_G per group of G input columns (H_G the normalised
regular Hadamard matrix), then rounded per row with scale = absmax / 127. The arithmetic below is written out
here in plain torch, independently of qwen21_core/quant (H_G entry by entry rather than as a Kronecker power),
so the loader tests check our code against it.
"""

from __future__ import annotations

import json

import torch

H4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)


def regular_hadamard(size: int) -> torch.Tensor:
    """comfy-kitchen's ConvRot matrix (its `_build_hadamard`: H4 Kronecker-multiplied with itself up to `size`,
    divided by sqrt(size)), fp64. A Kronecker power's entry [i, j] is the product of H4's entries at the base-4
    digits of i and j, which is how it is written here."""
    index = torch.arange(size)
    h = torch.ones(size, size, dtype=torch.float64)
    for shift in range(0, size.bit_length() - 1, 2):
        h *= H4[(index[:, None] >> shift) & 3, (index[None, :] >> shift) & 3]
    return h / size**0.5


def _rotated(w: torch.Tensor, group: int) -> torch.Tensor:
    return (w.reshape(w.shape[0], -1, group) @ regular_hadamard(group)).reshape(w.shape)


def marker(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def quantize_int8(weight: torch.Tensor, convrot: bool, group: int = 256) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(q int8 [N, K], scale fp32 [N, 1], marker dict) as ComfyUI stores an int8_tensorwise layer."""
    w = weight.double()
    rotate = convrot and w.shape[1] % group == 0
    if rotate:
        w = _rotated(w, group)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).float()
    q = (w / scale.double()).round().clamp(-128, 127).to(torch.int8)
    conf = {"format": "int8_tensorwise"}
    if rotate:
        conf |= {"convrot": True, "convrot_groupsize": group}
    return q, scale, conf


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    scale = (weight.float().abs().amax() / 448.0).reshape(())
    return (weight.float() / scale).to(torch.float8_e4m3fn), scale, {"format": "float8_e4m3fn"}


def quantized_state_dict(state_dict: dict, quantize, fmt: str, group: int = 256) -> dict:
    """A copy of `state_dict` with every weight for which `quantize(key, tensor)` is true stored in `fmt`
    ("int8_convrot" with ConvRot groups of `group`, "int8" or "fp8"); the other tensors in bf16."""
    out = {}
    for key, tensor in state_dict.items():
        if not (key.endswith(".weight") and tensor.dim() == 2 and quantize(key, tensor)):
            out[key] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            continue
        layer = key[: -len(".weight")]
        if fmt == "fp8":
            q, scale, conf = quantize_fp8(tensor)
        else:
            q, scale, conf = quantize_int8(tensor, convrot=fmt == "int8_convrot", group=group)
        out[key], out[f"{layer}.weight_scale"], out[f"{layer}.comfy_quant"] = q, scale, marker(conf)
    return out


def dequantized(q: torch.Tensor, scale: torch.Tensor, conf: dict) -> torch.Tensor:
    """What the stored layer means, in fp64: q * scale, rotated back for ConvRot (H_G is its own inverse)."""
    w = q.double() * scale.double().reshape(-1, 1)
    if conf.get("convrot"):
        w = _rotated(w, conf.get("convrot_groupsize", 256))
    return w
