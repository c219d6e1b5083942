"""Per-branch K/V storage for one generation: the prefix written once, the target part every step.

One cache per CFG branch. What persists is only the prefix (text and condition-image tokens), stored per layer:
- format "bf16" (the compute dtype), or quantised with one scale per token and head (kernels/kv_quant.py):
  "fp8" (K and V in e4m3), "fp8_v" (V in e4m3, K in the compute dtype), "int8" (K and V int8);
- placement "gpu", or "cpu": pinned host memory, each layer's prefix brought over on a side stream one layer
  ahead of its attention (memory/prefetch.py; two device slots at fixed addresses).
The step's target K/V live in one scratch buffer shared by all layers (a layer's attention reads them right after
writing them), and a quantised prefix is dequantised per layer into one reused buffer, so the device never holds
more than one layer's bf16 prefix beside the storage. Decode attention combines the prefix part and the target
part through their log-sum-exps (dit/attention.py).

`layout="joint"` keeps the first release's layout for comparison (batch 1, bf16, GPU only): per layer one
[P+N] buffer, prefix then target, read by a single attention call; it holds every layer's target K/V
(0.5 MiB per target token in bf16 for the released model).

All buffers are allocated once before the first step, so a step allocates nothing for the cache and addresses
stay fixed (which CUDA-graph replay relies on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.kv_quant import STORAGE, dequantize_kv, quantize_kv
from ..memory.pinned_buffers import HOST_KV_BUFFERS
from ..memory.prefetch import SlotPrefetcher

FORMATS = ("bf16", "fp8", "fp8_v", "int8")
PLACEMENTS = ("gpu", "cpu")
LAYOUTS = ("split", "joint")
_PARTS = {"bf16": (None, None), "fp8": ("fp8", "fp8"), "fp8_v": (None, "fp8"), "int8": ("int8", "int8")}


@dataclass(frozen=True)
class CacheShape:
    """What one branch's cache holds: layers, batch rows, prefix and target tokens, heads x head_dim."""

    num_layers: int
    batch: int
    prefix_len: int
    target_len: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def part_bytes(self, fmt: str | None) -> int:
        """Bytes of one layer's K (or V) prefix in a part format (None = the compute dtype), scales included."""
        values = self.prefix_len * self.heads * self.head_dim
        if fmt is None:
            return values * self.itemsize
        return values + 4 * self.prefix_len * self.heads

    def layer_bytes(self, fmt: str) -> int:
        return sum(self.part_bytes(part) for part in _PARTS[fmt])

    def device_bytes(self, fmt: str, placement: str, layout: str = "split") -> int:
        """Device memory the cache takes, every buffer counted: exactly what `PrefixKVCache` allocates."""
        kv_row = 2 * self.heads * self.head_dim * self.itemsize  # K and V of one token, one layer
        if layout == "joint":
            return self.num_layers * (self.prefix_len + self.target_len) * kv_row
        total = self.batch * self.target_len * kv_row  # the target scratch
        if placement == "gpu":
            total += self.num_layers * self.layer_bytes(fmt)
        else:
            total += 2 * self.layer_bytes(fmt)  # two staging slots
        if needs_work_buffer(fmt, placement):
            total += self.prefix_len * kv_row  # one layer's prefix in the compute dtype (prefill, dequantised)
        return total

    def host_bytes(self, fmt: str, placement: str) -> int:
        return self.num_layers * self.layer_bytes(fmt) if placement == "cpu" else 0


@dataclass(frozen=True)
class KVCacheSpec:
    """How a branch's prefix K/V are kept: storage format, placement, layout (see the module docstring)."""

    fmt: str = "bf16"
    placement: str = "gpu"
    layout: str = "split"

    def describe(self, dtype: torch.dtype, device: torch.device) -> str:
        """What the run stats say: the storage as it is ("bf16" is the compute dtype) and where it lives ("gpu" is
        the model's device)."""
        stored = str(dtype).removeprefix("torch.") if self.fmt == "bf16" else self.fmt
        where = "pinned CPU RAM" if self.placement == "cpu" else torch.device(device).type
        return f"{stored} on {where}"


def needs_work_buffer(fmt: str, placement: str) -> bool:
    """A bf16 prefix on the GPU is written and read in place; every other storage goes through one layer buffer."""
    return fmt != "bf16" or placement != "gpu"


class PrefixKVCache:
    def __init__(self, num_layers, batch, prefix_len, target_len, heads, head_dim, dtype, device, *,
                 fmt: str = "bf16", placement: str = "gpu", layout: str = "split"):  # fmt: skip
        if fmt not in FORMATS or placement not in PLACEMENTS or layout not in LAYOUTS:
            raise ValueError(
                f"K/V cache format must be one of {FORMATS}, placement one of {PLACEMENTS}, layout one of {LAYOUTS}; "
                f"got {fmt!r}, {placement!r}, {layout!r}"
            )
        if layout == "joint" and (batch != 1 or fmt != "bf16" or placement != "gpu"):
            raise ValueError("the joint K/V layout is for batch 1 with a bf16 prefix on the GPU")
        self.shape = CacheShape(num_layers, batch, prefix_len, target_len, heads, head_dim, dtype)
        self.fmt, self.placement, self.layout = fmt, placement, layout
        self.device = torch.device(device)
        self.batch = batch
        self.prefix_len = prefix_len
        self.target_len = target_len
        self.shared_prefix = layout == "split"  # decode attention merges a prefix part and a target part
        self.filled = False  # True once the prefill has written the prefix part
        self.prefix_id = None  # what the prefix part holds (set by the sampler), for reuse across runs
        self.prefetcher: SlotPrefetcher | None = None
        # Normal (not inference-mode) tensors: they may outlive this call inside a graph entry and be
        # written again under a different grad mode.
        with torch.inference_mode(False):
            self._allocate()

    # ---- allocation ---------------------------------------------------------------------------------

    def _allocate(self):
        s, device = self.shape, self.device
        per_token = (s.heads, s.head_dim)
        if self.layout == "joint":
            self._joint = torch.empty(s.num_layers, 2, 1, s.prefix_len + s.target_len, *per_token, dtype=s.dtype,
                                      device=device)  # fmt: skip
            self._target = None
            self._work = None
            self._storage = None
            return
        self._joint = None
        self._target = torch.empty(2, s.batch, s.target_len, *per_token, dtype=s.dtype, device=device)
        self._work = None
        if needs_work_buffer(self.fmt, self.placement):
            self._work = torch.empty(2, 1, s.prefix_len, *per_token, dtype=s.dtype, device=device)
        layer_bytes = s.layer_bytes(self.fmt)
        if self.placement == "gpu":
            self._storage = torch.empty(s.num_layers, layer_bytes, dtype=torch.uint8, device=device)
        else:
            # pinned, and kept for the next host cache when released (pinning takes seconds: memory/pinned_buffers.py)
            self._storage = HOST_KV_BUFFERS.take(s.num_layers * layer_bytes, device).view(s.num_layers, layer_bytes)
            self.prefetcher = SlotPrefetcher(device, layer_bytes, slots=2)
            self.prefetcher.set_items({layer: self._storage[layer] for layer in range(s.num_layers)})

    def _parts(self, flat: torch.Tensor):
        """Views of one layer's flat bytes: [(values, scale or None) for K, V], values [1, P, H, D]."""
        s = self.shape
        views, offset = [], 0
        for fmt in _PARTS[self.fmt]:
            count = s.prefix_len * s.heads * s.head_dim
            dtype = s.dtype if fmt is None else STORAGE[fmt]
            size = count * torch.empty((), dtype=dtype).element_size()
            values = flat[offset : offset + size].view(dtype).view(1, s.prefix_len, s.heads, s.head_dim)
            offset += size
            scale = None
            if fmt is not None:
                scale = flat[offset : offset + 4 * s.prefix_len * s.heads].view(torch.float32)
                scale = scale.view(1, s.prefix_len, s.heads)
                offset += 4 * s.prefix_len * s.heads
            views.append((values, scale, fmt))
        return views

    @property
    def allocated(self) -> bool:
        """True until `release`: the cache still holds its buffers."""
        return self._joint is not None or self._target is not None

    @property
    def nbytes(self) -> int:
        """Device bytes held by this cache."""
        return self.shape.device_bytes(self.fmt, self.placement, self.layout)

    @property
    def host_nbytes(self) -> int:
        return self.shape.host_bytes(self.fmt, self.placement) if self.layout == "split" else 0

    # ---- prefill --------------------------------------------------------------------------------------

    def prefill_targets(self, layer: int):
        """(k, v) [1, P, H, D] where the prefill writes this layer's prefix K/V (then `store_prefix(layer)`)."""
        if self._joint is not None:
            return self._joint[layer, 0, :, : self.prefix_len], self._joint[layer, 1, :, : self.prefix_len]
        if self.fmt == "bf16" and self.placement == "gpu":
            (k, _, _), (v, _, _) = self._parts(self._storage[layer])
            return k, v
        return self._work[0], self._work[1]

    def store_prefix(self, layer: int) -> None:
        """Move the layer's freshly written prefix K/V into its storage (quantised, and to the host, as set)."""
        if self._joint is not None or (self.fmt == "bf16" and self.placement == "gpu"):
            return  # written in place
        flat = self._storage[layer]
        if self.placement == "cpu":
            staging = torch.empty(flat.numel(), dtype=torch.uint8, device=self.device)
            self._encode(self._parts(staging))
            flat.copy_(staging, non_blocking=True)
        else:
            self._encode(self._parts(flat))

    def store_padded_prefix(self, kv: torch.Tensor) -> None:
        """Every layer's prefix K/V from `kv` [layers, 2, 1, P', H, D] (P' >= P; rows from P on are ignored): what a
        prefill graph wrote for a prompt padded to its bucket (dit/prefill_graphs.py). A bf16 prefix on the GPU is one
        copy; other storage goes through `store_prefix`, layer by layer."""
        s = self.shape
        if kv.shape[0] != s.num_layers or kv.shape[3] < s.prefix_len:
            raise ValueError(f"padded prefix K/V {tuple(kv.shape)} do not cover {s.num_layers} layers x "
                             f"{s.prefix_len} rows")  # fmt: skip
        rows = kv[:, :, :, : s.prefix_len]
        if self._joint is None and self.fmt == "bf16" and self.placement == "gpu":
            # a layer's bytes are K then V, each [1, P, H, D]: the storage is [layers, 2, 1, P, H, D]
            self._storage.view(s.dtype).view(s.num_layers, 2, 1, s.prefix_len, s.heads, s.head_dim).copy_(rows)
            return
        for layer in range(s.num_layers):
            k, v = self.prefill_targets(layer)
            k.copy_(rows[layer, 0])
            v.copy_(rows[layer, 1])
            self.store_prefix(layer)

    def _encode(self, parts) -> None:
        for (values, scale, fmt), source in zip(parts, (self._work[0], self._work[1]), strict=True):
            if fmt is None:
                values.copy_(source)
            else:
                q, s = quantize_kv(source, fmt)
                values.copy_(q)
                scale.copy_(s)

    # ---- decode ---------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start a decode pass: the host placement starts bringing the first layers' prefixes over."""
        if self.prefetcher is not None:
            self.prefetcher.begin()

    def prefix(self, layer: int):
        """(k, v) [1, P, H, D] of the layer's prefix in the compute dtype, on the device, for its attention."""
        if self._joint is not None:
            return self._joint[layer, 0, :, : self.prefix_len], self._joint[layer, 1, :, : self.prefix_len]
        flat = self.prefetcher.acquire(layer) if self.prefetcher is not None else self._storage[layer]
        parts = self._parts(flat)
        out = []
        for index, (values, scale, fmt) in enumerate(parts):
            if fmt is None:
                out.append(values)
            else:
                out.append(dequantize_kv(values, scale, self._work[index]))
        return out[0], out[1]

    def done_with(self, layer: int) -> None:
        """The layer's attention has read its prefix (the host placement refills the slot)."""
        if self.prefetcher is not None:
            self.prefetcher.release(layer)

    def target(self, layer: int):
        """(k, v) [B, N, H, D] where this step's target K/V are written (shared by all layers when split)."""
        if self._joint is not None:
            return self._joint[layer, 0, :, self.prefix_len :], self._joint[layer, 1, :, self.prefix_len :]
        return self._target[0], self._target[1]

    def joint(self, layer: int):
        """(k, v) [1, P+N, H, D] over prefix and target in the joint layout, else None."""
        if self._joint is None:
            return None
        return self._joint[layer, 0], self._joint[layer, 1]

    def release(self):
        if self._storage is not None and self.placement != "gpu":
            HOST_KV_BUFFERS.give_back(self._storage)
        self._joint = self._target = self._work = self._storage = None
        self.prefetcher = None
        self.filled = False
        self.prefix_id = None
