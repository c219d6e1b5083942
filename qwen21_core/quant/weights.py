"""Weight quantisation formats and their arithmetic: bf16 weights -> (q, per-row scale) and back.

A `QuantFormat` is what a quantised Linear stores and how it multiplies:
- "fp8":          float8_e4m3fn weights, one fp32 scale per output row (absmax / 448); activations are
                  quantised to e4m3 per row at run time; the GEMM is `torch._scaled_mm` (SM 8.9+).
- "int8":         int8 weights, one scale per output row (absmax / 127); activations int8 per row;
                  `torch._int_mm` (SM 7.5+).
- "int8_convrot": int8 as above, on weights and activations rotated in groups of 256 by the normalised
                  Hadamard matrix (kernels/quantize_rows.py): native ComfyUI's int8_convrot files, whose stored
                  weight is the rotated one (W_rot = W @ H; H is symmetric and orthogonal, so x W^T =
                  (x H)(W H)^T). A file may use another group comfy-kitchen writes (ROTATION_GROUPS: 4 to 1024,
                  the powers of 4); it runs with its own group. Quantising here always uses 256.
A per-tensor scale (older fp8 files) is the same as a per-row scale with every row equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.quantize_rows import QMAX, ROTATION_GROUP, ROTATION_GROUPS, STORAGE, rotate

ROW_CHUNK = 4096  # rows quantised at once, so a 24576-row weight needs a bounded fp32 temporary


@dataclass(frozen=True)
class QuantFormat:
    kind: str  # "fp8" | "int8"
    rotation: int = 0  # 0, or the ConvRot group (one of ROTATION_GROUPS)

    def __post_init__(self):
        if self.kind not in QMAX:
            raise ValueError(f"quantisation kind must be one of {sorted(QMAX)}, got {self.kind!r}")
        if self.rotation not in (0, *ROTATION_GROUPS) or (self.rotation and self.kind != "int8"):
            raise ValueError(
                f"ConvRot rotation {self.rotation} is not available for {self.kind}: int8 only, in groups of "
                f"{', '.join(map(str, ROTATION_GROUPS))}"
            )

    @property
    def name(self) -> str:
        return "int8_convrot" if self.rotation else self.kind

    @property
    def storage(self) -> torch.dtype:
        return STORAGE[self.kind]

    def for_width(self, in_features: int) -> QuantFormat:
        """This format for a layer of `in_features` inputs: ConvRot only where the groups fit (as ComfyUI)."""
        if self.rotation and in_features % self.rotation:
            return QuantFormat(self.kind)
        return self


FORMATS = {f.name: f for f in (QuantFormat("fp8"), QuantFormat("int8"), QuantFormat("int8", ROTATION_GROUP))}


def quantize_weight(weight: torch.Tensor, fmt: QuantFormat, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float weight -> (q [N, K] in fmt.storage, scale [N] fp32), on the weight's device, in row chunks.

    rotated: the weight is already in the format's rotated basis (W H, what a ConvRot layer stores), so it is not
    rotated again: a LoRA merge works there (lora/merge.py), which keeps unchanged values exact."""
    fmt = fmt.for_width(weight.shape[1])
    q = torch.empty(weight.shape, dtype=fmt.storage, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], ROW_CHUNK):
        rows = slice(start, start + ROW_CHUNK)
        w = weight[rows].float()
        if fmt.rotation and not rotated:
            w = rotate(w, fmt.rotation)
        s = w.abs().amax(dim=1).clamp(min=1e-30) / QMAX[fmt.kind]
        values = w / s[:, None]
        if fmt.kind == "int8":
            q[rows] = values.round_().clamp_(-128, 127).to(torch.int8)
        else:
            q[rows] = values.clamp_(-QMAX["fp8"], QMAX["fp8"]).to(torch.float8_e4m3fn)
        scale[rows] = s
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, rotation: int, dtype: torch.dtype) -> torch.Tensor:
    """(q [N, K], scale [N] or scalar) -> the float weight [N, K] in `dtype`, rotated back if it was rotated."""
    w = q.float() * scale.float().reshape(-1, 1)
    if rotation:
        w = rotate(w, rotation)  # H is its own inverse
    return w.to(dtype)


def requantize(q: torch.Tensor, scale: torch.Tensor, stored: QuantFormat, wanted: QuantFormat):
    """Stored quantised rows in another format: copied as they are when the formats match, else through fp32."""
    if stored == wanted.for_width(q.shape[1]) and q.dtype == wanted.storage:
        return q, scale.float().reshape(-1).expand(q.shape[0]).contiguous()
    return quantize_weight(dequantize_weight(q, scale, stored.rotation, torch.float32), wanted)
