"""Quantised checkpoint files written the way Comfy-Org's are, for the loader tests.

ComfyUI's mixed-precision ops read, per quantised Linear `<layer>`:
  <layer>.weight        int8 [N, K] (int8_tensorwise) or float8_e4m3fn [N, K]
  <layer>.weight_scale  fp32 [N, 1] (per row) or a scalar
  <layer>.comfy_quant   uint8 bytes of JSON: {"format": "int8_tensorwise", "convrot": true, "convrot_groupsize": 256}
                        (ConvRot only where K is a multiple of 256, as ComfyUI's converter does) or
                        {"format": "float8_e4m3fn"}
int8 ConvRot weights are stored rotated: W_rot = W @ H256 per group of 256 input columns (H256 the normalised
regular Hadamard matrix), then rounded per row with scale = absmax / 127. The arithmetic below is written out
here in plain torch, independently of qwen21_core/quant, so the loader tests check our code against it.
"""

from __future__ import annotations

import json

import torch

H4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)


def hadamard_256() -> torch.Tensor:
    h = H4
    for _ in range(3):
        h = torch.kron(h, H4)
    return h / 16.0


def marker(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def quantize_int8(weight: torch.Tensor, convrot: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(q int8 [N, K], scale fp32 [N, 1], marker dict) as ComfyUI stores an int8_tensorwise layer."""
    w = weight.double()
    rotate = convrot and w.shape[1] % 256 == 0
    if rotate:
        w = (w.reshape(w.shape[0], -1, 256) @ hadamard_256()).reshape(w.shape)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).float()
    q = (w / scale.double()).round().clamp(-128, 127).to(torch.int8)
    conf = {"format": "int8_tensorwise"}
    if rotate:
        conf |= {"convrot": True, "convrot_groupsize": 256}
    return q, scale, conf


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    scale = (weight.float().abs().amax() / 448.0).reshape(())
    return (weight.float() / scale).to(torch.float8_e4m3fn), scale, {"format": "float8_e4m3fn"}


def quantized_state_dict(state_dict: dict, quantize, fmt: str) -> dict:
    """A copy of `state_dict` with every weight for which `quantize(key, tensor)` is true stored in `fmt`
    ("int8_convrot", "int8" or "fp8"); the other tensors in bf16."""
    out = {}
    for key, tensor in state_dict.items():
        if not (key.endswith(".weight") and tensor.dim() == 2 and quantize(key, tensor)):
            out[key] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            continue
        layer = key[: -len(".weight")]
        if fmt == "fp8":
            q, scale, conf = quantize_fp8(tensor)
        else:
            q, scale, conf = quantize_int8(tensor, convrot=fmt == "int8_convrot")
        out[key], out[f"{layer}.weight_scale"], out[f"{layer}.comfy_quant"] = q, scale, marker(conf)
    return out


def dequantized(q: torch.Tensor, scale: torch.Tensor, conf: dict) -> torch.Tensor:
    """What the stored layer means, in fp64: q * scale, rotated back for ConvRot (H256 is its own inverse)."""
    w = q.double() * scale.double().reshape(-1, 1)
    if conf.get("convrot"):
        w = (w.reshape(w.shape[0], -1, 256) @ hadamard_256()).reshape(w.shape)
    return w
