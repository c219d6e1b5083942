"""How many device bytes a sampling run needs beside the DiT's weights: the prefix K/V caches of its CFG branches and
the activations of its largest step. The planner (planner.py) decides placement from these; the memory managers
(ours, ComfyUI's through our MODEL) are asked for this much room.

`job_bytes` counts from prefix lengths, for every caller: the ComfyUI MODEL (from the conditionings ComfyUI hands it)
and the benchmarks' checks against measured peaks. `request_bytes` counts one SampleRequest on a Conditioning, as the
pipeline and the model handle ask before a run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..dit.kv_cache import CacheShape
from ..dit.sequence import TOKENS_PER_SLOT
from ..options import SampleOptions
from ..parallel.modes import expected_mode
from ..request import SampleRequest

# Peak activations of a step beyond weights and K/V cache, in units of (tokens x inner_dim x element size); fitted to
# a decode step's measured peak (bench_dit's `ours_decode_peak_extra_mib`, which tests/test_sampler.py checks it by).
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


def request_bytes(config, dtype: torch.dtype, cond, request: SampleRequest, options: SampleOptions | None = None,
                  workers=None) -> tuple[dict[str, int], int]:  # fmt: skip
    """`job_bytes` of one run of `request` on `cond` (a Conditioning) on this device: a branch per prompt the guidance
    uses (a negative prompt not encoded yet counts by its token count), each image slot as its latent tokens, and
    with `workers` (a WorkerPool) this device's share where the options split the run over them."""
    options = options or SampleOptions()
    request = request.sized(cond)
    use_cfg = request.guided and cond.has_negative
    mode = expected_mode(options.parallel, workers, use_cfg)
    lengths = [cond.positive.length] + ([cond.negative_length] if use_cfg and mode != "cfg" else [])  # cfg: on rank 1
    slots = sum(h * w for h, w in cond.image_shapes) // TOKENS_PER_SLOT
    prefixes = [length + (TOKENS_PER_SLOT - 1) * slots for length in lengths]  # a slot's row becomes 4 latent rows
    ranks = workers.world if mode == "sequence" else 1  # this device's share of heads and rows: 1/ranks
    return job_bytes(config, dtype, prefixes, request.target_tokens, request.batch_size, options.kv_cache,
                     options.kv_layout, ranks)  # fmt: skip


def sampling_bytes(config, dtype: torch.dtype, cond, request: SampleRequest, options: SampleOptions | None = None,
                   workers=None, kv_placement: str | None = None) -> int:  # fmt: skip
    """Device memory a run needs beyond the weights: its K/V caches (exactly what they allocate) where `kv_placement`
    puts them plus the larger of the prefill's and a decode step's activations. kv_placement None: the options'
    placement, "auto" counted as the GPU (the larger)."""
    options = options or SampleOptions()
    caches, activations = request_bytes(config, dtype, cond, request, options, workers)
    placement = kv_placement or (options.kv_placement if options.kv_placement != "auto" else "gpu")
    return caches[placement] + activations
