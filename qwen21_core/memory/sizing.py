"""How many device bytes a sampling run needs beside the DiT's weights: the prefix K/V caches of its CFG branches and
the activations of its largest step. The planner (planner.py) decides placement from these; the memory managers
(ours, ComfyUI's through our MODEL) are asked for this much room.

One function for every caller: the pipeline (from a Conditioning), the ComfyUI MODEL (from the prefix lengths of the
conditionings ComfyUI hands it) and the benchmarks' checks against measured peaks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dit.kv_cache import CacheShape

# Peak activations of a step beyond weights and K/V cache, in units of (tokens x inner_dim x element size); fitted to
# a decode step's measured peak (benchmarks: bench_dit `ours_decode_peak_extra_mib`).
ACTIVATION_FACTOR = 16
PLACEMENTS = ("gpu", "cpu")


def job_bytes(config, dtype: torch.dtype, prefix_lengths: Sequence[int], target_tokens: int, batch: int,
              kv_cache: str = "bf16", kv_layout: str = "split", ranks: int = 1) -> tuple[dict[str, int], int]:
    """(K/V cache device bytes by placement, activation bytes) of one run.

    prefix_lengths: one per CFG branch on this device (text rows plus 4 latent rows per image slot); target_tokens:
    the output's latent tokens; batch: rows sharing each prefix; ranks: devices splitting heads and rows (sequence
    parallel), this device holding 1/ranks. Branches run one after another: their caches add up, activations do not.
    """
    element = torch.empty(0, dtype=dtype).element_size()
    heads = -(-config.num_attention_heads // ranks)
    caches, activations = dict.fromkeys(PLACEMENTS, 0), 0
    for prefix in prefix_lengths:
        shape = CacheShape(config.num_layers, batch, prefix, target_tokens, heads, config.attention_head_dim, dtype)
        for placement in caches:
            caches[placement] += shape.device_bytes(kv_cache, placement, kv_layout if placement == "gpu" else "split")
        tokens = -(-max(prefix, batch * target_tokens) // ranks)
        activations = max(activations, ACTIVATION_FACTOR * tokens * config.inner_dim * element)
    return caches, activations
