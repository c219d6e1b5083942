"""`QuantLinear`: a Linear whose weight stays quantised in memory (FP8 e4m3 or INT8, one scale per output row).

How it multiplies, per device (`gemm_backend`):
- "scaled_mm": FP8 W8A8 on GPUs with FP8 tensor cores (SM 8.9+): activations quantised per row
  (kernels/quantize_rows.py), `torch._scaled_mm` with row-wise scales, bf16 out;
- "triton_int8": INT8 W8A8 (SM 7.5+) through kernels/int8_gemm.py: activations int8 per row, both operands
  K-major, scales (and the block's gated residual) applied in the GEMM's epilogue, bf16 out;
- "int_mm": INT8 W8A8 where the Triton kernel cannot run: `torch._int_mm` against the column-major view of
  the row-major [N, K] weight (the fast layout: cuBLAS ran a row-major second operand far slower),
  int32 out, scales applied by the consumer's kernel (kernels/linear_epilogue.py) or `Projected.dense`;
- "weight_only": everywhere else (CPU, older GPUs, tiny M) and always for the text encoder: the weight is
  dequantised just in time, for this layer only, and multiplied in the activation dtype (ConvRot layers rotate the
  activation instead of the weight: cheaper whenever M < N). On CUDA the dequantisation is one Triton kernel
  (kernels/dequantize_weight.py: one read of the stored weight, one write in the activation dtype, bit-identical to
  torch's fp32 expression), used once the background warm-up compiled it (quant/kernel_warmup.py) so that no
  encode waits for the compile; torch's expression serves until then and on the CPU.
`QWEN21_QUANT_GEMM=weight_only|emulate` (kernels/settings.py) overrides the choice; "emulate" computes the W8A8
arithmetic in fp32 (quantised activations times quantised weights), so CPU tests see what the GPU path computes.

The DiT's blocks call `quantize_input` / `project` themselves so the activation quantisation happens inside the
op before (dit/quant_math.py); `forward` is the plain, unfused use (the text encoder, the tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.dequantize_weight import dequantize_for_linear, dequantize_weight_reference
from ...kernels.int8_gemm import int8_linear
from ...kernels.linear_epilogue import linear_epilogue
from ...kernels.quantize_rows import quantize_rows, rotate
from .. import settings
from ..memory.planner import indexed_device
from .weights import QuantFormat, dequantize_weight, quantize_weight

log = logging.getLogger(__name__)

# FP8 GEMMs with Hopper's fast accumulation (fewer promotions of the partial sums). It made the decode step faster
# and left the per-GEMM error where it was (bench_quant's fast_accum_rel_error, bench_dit's dit_fp8_accumulation),
# so it is on; bench_dit sets it False to compare.
FP8_FAST_ACCUM = True
INT_MM_MIN_ROWS = 17  # torch._int_mm needs more than 16 rows
_backends: dict[tuple[torch.device, str], str] = {}  # (device, kind) -> backend, probed once


@dataclass
class Projected:
    """A GEMM's output [M, N]: values in the activation dtype, or an int32 accumulator with its scales."""

    data: torch.Tensor
    row_scale: torch.Tensor | None = None
    col_scale: torch.Tensor | None = None

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        if self.row_scale is None:
            return self.data.to(dtype)
        return linear_epilogue(self.data, row_scale=self.row_scale, col_scale=self.col_scale, out_dtype=dtype)


class QuantLinear(nn.Module):
    """y = x W^T with W stored as `qweight` [N, K] (fp8/int8) and `weight_scale` [N] fp32 (per output row)."""

    def __init__(self, in_features: int, out_features: int, fmt: QuantFormat, compute_dtype=torch.bfloat16,
                 quantize_activations: bool = True):  # fmt: skip
        super().__init__()
        self.fmt = fmt.for_width(in_features)
        self.compute_dtype = compute_dtype
        # False: always the weight-only path (the memory saving without the activations' rounding), for models
        # whose error compounds over many layers and whose speed matters little (the text encoder)
        self.quantize_activations = quantize_activations
        self.qweight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.fmt.storage), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        # build_empty (checkpoints/files.py) keeps these dtypes instead of casting to the model's dtype
        self.param_dtypes = {"qweight": self.fmt.storage, "weight_scale": torch.float32}
        # LoRA kept beside the quantised weight instead of merged into it (lora/merge.py): None, or a
        # LowRankSidePath whose output is added to this layer's (see set_side_paths)
        self.side_path: LowRankSidePath | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor, fmt: QuantFormat, quantize_activations: bool = True) -> QuantLinear:
        """Quantise a float weight [N, K] (on its device) into a new layer computing in its dtype."""
        layer = cls(weight.shape[1], weight.shape[0], fmt, compute_dtype=weight.dtype,
                    quantize_activations=quantize_activations).to(weight.device)  # fmt: skip
        q, scale = quantize_weight(weight, layer.fmt)
        with torch.no_grad():
            layer.qweight.copy_(q)
            layer.weight_scale.copy_(scale)
        return layer

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def extra_repr(self) -> str:
        compute = "" if self.quantize_activations else ", weight-only"
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.name}{compute}"

    # ---- arithmetic --------------------------------------------------------------------------------

    def backend(self, rows: int) -> str:
        """How a GEMM of `rows` activation rows runs on this layer's device (see the module docstring)."""
        forced = settings.current().quant_gemm
        if forced is not None:
            return forced
        backend = gemm_backend(self.qweight.device, self.fmt.kind)
        if backend == "int_mm" and rows < INT_MM_MIN_ROWS:
            return "weight_only"
        return backend

    def quantize_input(self, x2d: torch.Tensor, **pre) -> tuple[torch.Tensor, torch.Tensor]:
        """The activation rows (after the fused pre-op in `pre`, see quantize_rows) quantised for this layer."""
        return quantize_rows(x2d, self.fmt.kind, self.fmt.rotation, **pre)

    def project(self, q: torch.Tensor, scale: torch.Tensor, backend: str) -> Projected:
        """The GEMM on quantised activations (q [M, K], scale [M]) with a W8A8 backend."""
        if backend == "triton_int8":
            return Projected(int8_linear(q, scale, self.qweight, self.weight_scale, out_dtype=self.compute_dtype))
        if backend == "scaled_mm":
            out = torch._scaled_mm(q, self.qweight.t(), scale_a=scale[:, None], scale_b=self.weight_scale[None, :],
                                   out_dtype=self.compute_dtype, use_fast_accum=FP8_FAST_ACCUM)  # fmt: skip
            return Projected(out)
        if backend == "int_mm":
            return Projected(torch._int_mm(q, self.qweight.t()), scale, self.weight_scale)
        if backend == "emulate":
            weight = self.qweight.float() * self.weight_scale[:, None]
            return Projected((q.float() * scale[:, None]) @ weight.t())
        raise ValueError(f"project needs a W8A8 backend, got {backend!r}")

    def project_residual(self, q, scale, backend: str, residual, gate, rows_per_batch: int) -> torch.Tensor:
        """residual + gate[row's batch] * (the GEMM), with the residual fused into the GEMM where it can be."""
        if backend == "triton_int8":
            return int8_linear(q, scale, self.qweight, self.weight_scale, residual=residual, gate=gate,
                               rows_per_batch=rows_per_batch)  # fmt: skip
        out = self.project(q, scale, backend)
        return linear_epilogue(out.data, row_scale=out.row_scale, col_scale=out.col_scale, residual=residual, gate=gate,
                               rows_per_batch=rows_per_batch)  # fmt: skip

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The stored (rotated, for ConvRot) weight in `dtype`: for the weight-only path. q * scale in fp32, rounded
        once to `dtype`: on CUDA one kernel (kernels/dequantize_weight.py) once it is compiled, torch's expression
        until then and on the CPU, with the same bits."""
        if self.qweight.is_cuda:
            return dequantize_for_linear(self.qweight, self.weight_scale, dtype)
        return dequantize_weight_reference(self.qweight, self.weight_scale, dtype)

    def weight_only(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt.rotation:
            x = rotate(x.float(), self.fmt.rotation).to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype))

    def float_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in the original (unrotated) basis, for checks and for LoRA merges of dequantised copies."""
        return dequantize_weight(self.qweight, self.weight_scale, self.fmt.rotation, dtype)

    def set_side_paths(self, paths: list[tuple[slice, torch.Tensor, torch.Tensor]]) -> None:
        """LoRA factors to add to the output: (rows of the output, down [r, K], up [rows, r]) with the strength and
        alpha/rank folded into `up`; [] removes them. The quantised weight is never touched."""
        self.side_path = LowRankSidePath(paths, self.qweight.device, self.compute_dtype) if paths else None

    def project_rows(self, x2d: torch.Tensor) -> Projected:
        """The unfused GEMM of activation rows x2d [M, K]: weight-only, or quantised and projected with this device's
        W8A8 backend (its output possibly an accumulator with scales, for an epilogue to finish)."""
        backend = self.backend(x2d.shape[0]) if self.quantize_activations else "weight_only"
        if backend == "weight_only":
            return Projected(self.weight_only(x2d))
        return self.project(*self.quantize_input(x2d.contiguous()), backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        y = self.project_rows(x2d).dense(x.dtype)
        if self.side_path is not None:
            self.side_path.add_to(y, x2d)
        return y.reshape(*x.shape[:-1], self.out_features)


class LowRankSidePath(nn.Module):
    """y += x A^T B^T for a list of LoRA pieces (rows of y, down A_i [r_i, K], up B_i [rows_i, r_i]).

    The pieces share the layer's input, so their downs are concatenated and the input is projected once
    (h = x A_cat^T, [M, sum r_i]); each up then adds h's columns of its piece onto its rows of y, in place (a GEMM
    writing into a column block of y: no copy of y). For a fused QKV layer with a LoRA on to_q/to_k/to_v that is 4
    GEMMs where separate side paths took 6; for gate_up 3 instead of 4. The factors are buffers, so they move with
    the layer, and captured decode graphs are rebuilt when they change (`signature`, dit/decode_graphs.py)."""

    def __init__(self, pieces: list[tuple[slice, torch.Tensor, torch.Tensor]], device, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("down", torch.cat([down for _, down, _ in pieces]).to(device, dtype), persistent=False)
        self.pieces: list[tuple[slice, slice]] = []  # (rows of y, columns of h) per piece
        start = 0
        for index, (rows, down, up) in enumerate(pieces):
            self.register_buffer(f"up_{index}", up.to(device, dtype), persistent=False)
            self.pieces.append((rows, slice(start, start + down.shape[0])))
            start += down.shape[0]

    def signature(self) -> tuple:
        """What a captured CUDA graph depends on: the factors' addresses and shapes, and the rows they go to."""
        factors = tuple((t.data_ptr(), tuple(t.shape), t.dtype) for t in self.buffers())
        return factors, tuple((rows.start, rows.stop) for rows, _ in self.pieces)

    def add_to(self, y: torch.Tensor, x2d: torch.Tensor) -> None:
        """y [M, N] += the pieces' products on x2d [M, K], in x's dtype (the factors are cast if the model's
        activations differ from the dtype they were made in)."""
        h = x2d @ self.down.to(x2d.dtype).t()
        for index, (rows, columns) in enumerate(self.pieces):
            y[:, rows].addmm_(h[:, columns], getattr(self, f"up_{index}").to(y.dtype).t())


def quantize_linears_(module: nn.Module, names, fmt: QuantFormat, quantize_activations: bool = True) -> nn.Module:
    """Replace the named nn.Linear submodules of `module` by QuantLinears quantised from their weights, one at a
    time (each float weight is freed as its layer is done). For models built in memory: benchmarks and tests."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        linear = getattr(parent, child)
        if isinstance(linear, nn.Linear):
            setattr(parent, child, QuantLinear.from_weight(linear.weight.detach(), fmt, quantize_activations))
    return module


# ---------------------------------------------------------------------------------------------------------
# Which GEMM a device can run
# ---------------------------------------------------------------------------------------------------------


def gemm_backend(device: torch.device, kind: str) -> str:
    """The W8A8 backend for quantised `kind` ("fp8"/"int8") weights on `device`, probed once per device."""
    found = _backends.get((device, kind))  # the hot path (asked per layer and step): a tensor's device has its index
    if found is not None:
        return found
    device = indexed_device(device)
    if device.type != "cuda":
        return "weight_only"
    if (device, kind) not in _backends:
        _backends[(device, kind)] = _probe(device, kind)
    return _backends[(device, kind)]


def _probe(device: torch.device, kind: str) -> str:
    """The first backend that runs a small GEMM right: int8 prefers our Triton kernel (faster than cuBLAS's on
    Hopper, see kernels/int8_gemm.py) over torch._int_mm."""
    major, minor = torch.cuda.get_device_capability(device)
    candidates, needs = (["scaled_mm"], (8, 9)) if kind == "fp8" else (["triton_int8", "int_mm"], (7, 5))
    if (major, minor) < needs:
        log.info("%s weights on %s (SM %d.%d): no %s tensor cores; dequantising per layer", kind, device, major,
                 minor, kind)  # fmt: skip
        return "weight_only"
    layer = QuantLinear.from_weight(torch.randn(64, 256, device=device, dtype=torch.bfloat16), QuantFormat(kind))
    x = torch.randn(32, 256, device=device, dtype=torch.bfloat16)
    want = F.linear(x.float(), layer.float_weight(torch.float32))
    for backend in candidates:
        try:  # some builds lack the row-wise FP8 kernels, or Triton / _int_mm on this architecture
            q, scale = layer.quantize_input(x)
            got = layer.project(q, scale, backend).dense(torch.float32)
            if not torch.isfinite(got).all() or (got - want).norm() > 0.1 * want.norm():
                raise RuntimeError(f"wrong result (relative error {((got - want).norm() / want.norm()).item():.3f})")
            return backend
        except Exception as error:  # noqa: BLE001 - any failure: try the next backend, and say why
            log.warning("%s W8A8 GEMM %s unavailable on %s (%s)", kind, backend, device, error)
    log.warning("no %s W8A8 GEMM runs on %s; dequantising per layer instead", kind, device)
    return "weight_only"
