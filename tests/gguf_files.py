"""GGUF files for the tests, written with the `gguf` package's writer: blocks from gguf's own quantiser where it has
one (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) and from the small reference quantisers here for the K-quants, which gguf only
dequantises. Each reference quantiser also returns the values its blocks mean (computed here, in gguf-py's fp32
order), so a test can check that gguf's dequantiser reads back what was meant."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    """[B] float32 -> [B, 2] uint8 (their fp16 bytes) and the fp16 values as float32."""
    half = values.astype(np.float16)
    return half.view(np.uint8).reshape(-1, 2), half.astype(np.float32)


def quantize_q4_k(x: np.ndarray, high_bit: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] float32 (K a multiple of 256) -> (Q4_K rows, or Q5_K with high_bit, uint8 [N, bytes]; the values
    they mean, float32 [N, K]). Per sub-block of 32: q in 0..15 (0..31), x ~ d*sc*q - dmin*m."""
    levels = 31 if high_bit else 15
    blocks = x.reshape(-1, 8, 32)
    lo = np.minimum(blocks.min(-1), 0)
    scale = np.maximum((blocks.max(-1) - lo) / levels, 1e-8)
    d_bytes, d = _f16(scale.max(-1) / 63)
    m_bytes, dmin = _f16(np.maximum((-lo).max(-1), 1e-8) / 63)
    sc = np.clip(np.round(scale / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    ds = (d[:, None] * sc.astype(np.float32))[..., None]
    dm = (dmin[:, None] * mn.astype(np.float32))[..., None]
    q = np.clip(np.round((blocks + dm) / ds), 0, levels).astype(np.uint8)
    meant = (ds * q.astype(np.float32) - dm).reshape(x.shape)
    packed = np.zeros((blocks.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    low = q & 0x0F
    qs = (low[:, 0::2, :] | (low[:, 1::2, :] << 4)).reshape(-1, 128)
    parts = [d_bytes, m_bytes, packed]
    if high_bit:
        parts.append(sum(((q[:, j, :] >> 4) & 1) << j for j in range(8)).astype(np.uint8))
    rows = np.concatenate([*parts, qs], axis=1).reshape(x.shape[0], -1)
    return rows, meant


def quantize_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[N, K] -> (Q6_K rows, the values they mean). Per 16 values: int8 scale, q in -32..31, x ~ d*sc*q."""
    blocks = x.reshape(-1, 16, 16)
    scale = np.maximum(np.abs(blocks).max(-1) / 31, 1e-8)
    d_bytes, d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.round(scale / d[:, None]), 1, 127).astype(np.int8)
    ds = (d[:, None] * sc.astype(np.float32))[..., None]
    q = np.clip(np.round(blocks / ds), -32, 31).astype(np.int8)
    meant = (ds * q.astype(np.float32)).reshape(x.shape)
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # half, group of 32, lane
    low, high = u & 0x0F, u >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    rows = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=1)
    return rows.reshape(x.shape[0], -1), meant


def quantize(x: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows of `qtype` blocks for [N, K] float32 and the values they mean (gguf's dequantisation of them)."""
    import gguf

    if qtype == "Q4_K":
        return quantize_q4_k(x)
    if qtype == "Q5_K":
        return quantize_q4_k(x, high_bit=True)
    if qtype == "Q6_K":
        return quantize_q6_k(x)
    kind = getattr(gguf.GGMLQuantizationType, qtype)
    rows = gguf.quants.quantize(x, kind)
    return rows, gguf.quants.dequantize(rows, kind).reshape(x.shape).astype(np.float32)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str | None = "qwen_image21") -> Path:
    """A GGUF file of `tensors` (name -> (values [.., K] float32, type)): float types stored as themselves, block
    types quantised here. arch None: no general.architecture (as stable-diffusion.cpp writes its files)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch or "")
    if arch is None:
        writer.kv_data[0].pop(gguf.Keys.General.ARCHITECTURE, None)
    for name, (values, qtype) in tensors.items():
        if qtype in ("F32", "F16"):
            writer.add_tensor(name, values.astype(np.float32 if qtype == "F32" else np.float16))
        elif qtype == "BF16":
            bf16 = torch.from_numpy(np.ascontiguousarray(values)).to(torch.bfloat16).view(torch.uint8).numpy()
            writer.add_tensor(name, bf16.reshape(*values.shape[:-1], -1), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            rows, _meant = quantize(values.reshape(-1, values.shape[-1]), qtype)
            writer.add_tensor(name, rows.reshape(*values.shape[:-1], -1),
                              raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dit_gguf(path: Path, state_dict: dict[str, torch.Tensor], block_type: str, other_type: str = "F32",
             arch: str | None = "qwen_image21") -> tuple[Path, dict[str, torch.Tensor]]:  # fmt: skip
    """A DiT state dict (ComfyUI names, fused gate_up) as a GGUF: block Linears in `block_type`, every other tensor
    in `other_type` (1-D ones in F32). Returns the file and the state dict of the values it holds (what a float
    file of the same model would hold)."""
    tensors, meant = {}, {}
    for name, tensor in state_dict.items():
        values = tensor.float().numpy()
        qtype = block_type if "transformer_blocks." in name and values.ndim == 2 else other_type
        qtype = "F32" if values.ndim == 1 else qtype
        tensors[name] = (values, qtype)
        if qtype in ("F32", "F16", "BF16"):
            held = torch.from_numpy(values.copy())
            meant[name] = held if qtype == "F32" else held.to(getattr(torch, {"F16": "float16"}.get(qtype, "bfloat16")))
        else:
            meant[name] = torch.from_numpy(quantize(values.reshape(-1, values.shape[-1]), qtype)[1]).view_as(tensor)
    return write_gguf(path, tensors, arch), {name: t.float() for name, t in meant.items()}
