"""Per-branch K/V storage for one generation: the prefix written once, the target part every step.

One cache per CFG branch. All layers live in one allocation, made before the first step; decode
steps write the target K/V in place, so a step allocates nothing for the cache and the addresses
stay fixed (which CUDA-graph replay relies on).

Two shapes:
- batch 1 (`shared_prefix=False`): per layer one [1, P+N, H, D] buffer, prefix then target, so decode
  attention is a single call over contiguous keys;
- batch B > 1 of one conditioning (`shared_prefix=True`): the prefix [1, P, H, D] once, the target
  [B, N, H, D] per row; decode merges the two attentions (no B-fold prefix).

Size: 2 * layers * (P + B*N) * heads * head_dim * dtype bytes, e.g. prefix_len x 512 KiB in bf16 for the
released model (32 layers x 4096 channels).
"""

from __future__ import annotations

import torch


class PrefixKVCache:
    def __init__(self, num_layers, batch, prefix_len, target_len, heads, head_dim, dtype, device):
        self.num_layers = num_layers
        self.batch = batch
        self.prefix_len = prefix_len
        self.target_len = target_len
        self.shared_prefix = batch > 1
        self.filled = False  # True once the prefill has written the prefix part
        self.prefix_id = None  # what the prefix part holds (set by the sampler), for reuse across runs
        # Normal (not inference-mode) tensors: they may outlive this call inside a graph entry and be
        # written again under a different grad mode.
        with torch.inference_mode(False):
            self._allocate(num_layers, batch, prefix_len, target_len, heads, head_dim, dtype, device)

    def _allocate(self, num_layers, batch, prefix_len, target_len, heads, head_dim, dtype, device):
        if self.shared_prefix:
            self._prefix = torch.empty(num_layers, 2, 1, prefix_len, heads, head_dim, dtype=dtype, device=device)
            self._target = torch.empty(num_layers, 2, batch, target_len, heads, head_dim, dtype=dtype, device=device)
            self._joint = None
        else:
            self._joint = torch.empty(
                num_layers, 2, 1, prefix_len + target_len, heads, head_dim, dtype=dtype, device=device
            )
            self._prefix = self._joint[:, :, :, :prefix_len]
            self._target = self._joint[:, :, :, prefix_len:]

    @property
    def nbytes(self) -> int:
        if self._joint is not None:
            return self._joint.numel() * self._joint.element_size()
        return (self._prefix.numel() + self._target.numel()) * self._prefix.element_size()

    def prefix(self, layer: int):
        """(k, v) views [1, P, H, D] of a layer's prefix part."""
        return self._prefix[layer, 0], self._prefix[layer, 1]

    def target(self, layer: int):
        """(k, v) views [B, N, H, D] of a layer's target part (written every step)."""
        return self._target[layer, 0], self._target[layer, 1]

    def joint(self, layer: int):
        """(k, v) views [1, P+N, H, D] over prefix and target, or None for a shared-prefix batch."""
        if self._joint is None:
            return None
        return self._joint[layer, 0], self._joint[layer, 1]

    def release(self):
        self._joint = self._prefix = self._target = None
        self.filled = False
        self.prefix_id = None
