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

from .. import settings
from ..dit.kv_cache import CacheShape
from ..dit.sequence import TOKENS_PER_SLOT
from ..options import SampleOptions
from ..parallel.modes import expected_mode
from ..request import SampleRequest

# Peak activations of a step beyond weights and K/V cache, in units of (tokens x inner_dim x element size); fitted to
# a decode step's measured peak (bench_dit's `ours_decode_peak_extra_mib`, which tests/test_sampler.py checks it by).
ACTIVATION_FACTOR = 16
# A controlled step also holds the control stream's hidden state and its skip beside the base's (same units)
CONTROL_ACTIVATION_FACTOR = 4
PLACEMENTS = ("gpu", "cpu")


def job_bytes(config, dtype: torch.dtype, prefix_lengths: Sequence[int], target_tokens: int, batch: int,
              kv_cache: str = "bf16", kv_layout: str = "split", ranks: int = 1, control_layers: int = 0,
              plain_beside: bool = False) -> tuple[dict[str, int], int]:  # fmt: skip
    """(K/V cache device bytes by placement, activation bytes) of one run.

    prefix_lengths: one per CFG branch on this device (text rows plus 4 latent rows per image slot); target_tokens:
    the output's latent tokens; batch: rows sharing each prefix; ranks: devices splitting heads and rows (sequence
    parallel), this device holding 1/ranks. Branches run one after another: their caches add up, activations do not.
    control_layers: the Fun-Control blocks a controlled branch runs beside (their K/V, the stream's start);
    plain_beside: a plain branch per side lives beside the controlled one (steps outside the control range on both
    sides of it).
    """
    element = torch.empty(0, dtype=dtype).element_size()
    heads = -(-config.num_attention_heads // ranks)
    caches, activations = dict.fromkeys(PLACEMENTS, 0), 0
    factor = ACTIVATION_FACTOR + (CONTROL_ACTIVATION_FACTOR if control_layers else 0)
    if control_layers and settings.current().control_stream:
        # the control blocks run ahead on a side stream: each block's output until the base takes it (one unit per
        # control block) and a second block's working set beside the base's, counted as a whole step's
        factor += control_layers + ACTIVATION_FACTOR
    for prefix in prefix_lengths:
        shapes = [CacheShape(config.num_layers, batch, prefix, target_tokens, heads, config.attention_head_dim, dtype)]
        if control_layers:
            shapes.append(CacheShape(control_layers, batch, prefix, target_tokens, heads, config.attention_head_dim,
                                     dtype))  # fmt: skip
            if plain_beside:
                shapes.append(shapes[0])
        for placement in caches:
            layout = kv_layout if placement == "gpu" else "split"
            caches[placement] += sum(shape.device_bytes(kv_cache, placement, layout) for shape in shapes)
            if control_layers:
                caches[placement] += target_tokens * config.inner_dim * element  # the control stream's start
        tokens = -(-max(prefix, batch * target_tokens) // ranks)
        activations = max(activations, factor * tokens * config.inner_dim * element)
    return caches, activations


def request_bytes(config, dtype: torch.dtype, cond, request: SampleRequest, options: SampleOptions | None = None,
                  workers=None) -> tuple[dict[str, int], int]:  # fmt: skip
    """`job_bytes` of one run of `request` on `cond` (a Conditioning) on this device: a branch per prompt the guidance
    uses (a negative prompt not encoded yet counts by its token count), each image slot as its latent tokens, and
    with `workers` (a WorkerPool) this device's share where the options split the run over them."""
    options = options or SampleOptions()
    request = request.sized(cond)
    use_cfg = request.guided and cond.has_negative
    mode = None if request.controlled else expected_mode(options.parallel, workers, use_cfg)  # control: one device
    lengths = [cond.positive.length] + ([cond.negative_length] if use_cfg and mode != "cfg" else [])  # cfg: on rank 1
    slots = sum(h * w for h, w in cond.image_shapes) // TOKENS_PER_SLOT
    prefixes = [length + (TOKENS_PER_SLOT - 1) * slots for length in lengths]  # a slot's row becomes 4 latent rows
    ranks = workers.world if mode == "sequence" else 1  # this device's share of heads and rows: 1/ranks
    control = request.control if request.controlled else None
    control_layers = len(control.net.control_blocks) if control is not None else 0
    plain_beside = control is not None and control.start > 0 and control.end < 1
    return job_bytes(config, dtype, prefixes, request.target_tokens, request.batch_size, options.kv_cache,
                     options.kv_layout, ranks, control_layers, plain_beside)  # fmt: skip


def sampling_bytes(config, dtype: torch.dtype, cond, request: SampleRequest, options: SampleOptions | None = None,
                   workers=None, kv_placement: str | None = None) -> int:  # fmt: skip
    """Device memory a run needs beyond the weights: its K/V caches (exactly what they allocate) where `kv_placement`
    puts them plus the larger of the prefill's and a decode step's activations. kv_placement None: the options'
    placement, "auto" counted as the GPU (the larger)."""
    options = options or SampleOptions()
    caches, activations = request_bytes(config, dtype, cond, request, options, workers)
    placement = kv_placement or (options.kv_placement if options.kv_placement != "auto" else "gpu")
    return caches[placement] + activations
