"""How a generation runs (not what it makes: that is request.py's SampleRequest): one small object that travels
from the sampler node through the model handle and the pipeline to the sampler, instead of a keyword argument per
option at every layer.

Defaults are the exact path; every field that changes numerics says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .dit.attention import BACKENDS as ATTENTION_BACKENDS
from .dit.kv_cache import FORMATS as KV_FORMATS
from .dit.kv_cache import LAYOUTS as KV_LAYOUTS
from .dit.kv_cache import PLACEMENTS as KV_PLACEMENTS
from .dit.kv_cache import KVCacheSpec

PARALLEL_MODES = ("auto", "off", "cfg", "sequence")


@dataclass(frozen=True)
class SampleOptions:
    """prefix_cache:      cache the text/condition prefix K/V after step 1 (False recomputes it every step,
                          for checking; identical results, slower).
    decode_graphs:     replay decode steps from CUDA graphs (CUDA only; bit-identical to eager decode), and with
                       quantised blocks a text prompt's prefill too (dit/prefill_graphs.py; bit-identical K/V).
    compile_blocks:    regional torch.compile of the bf16 block math (opt-in; not bit-identical).
    attention_backend: SDPA backend, one of ATTENTION_BACKENDS ("auto" lets torch choose, but not cuDNN in the prefill,
                       whose shapes change with every prompt: dit/attention.py backend_context).
    kv_cache:          how the prefix K/V are stored: "bf16" (the compute dtype, exact), "fp8" (K and V in e4m3,
                       one scale per token and head), "fp8_v" (V only) or "int8" (K and V): lossy, half the memory.
    kv_placement:      "gpu", "cpu" (pinned host RAM, each layer prefetched one layer ahead) or "auto" (the GPU
                       while it fits the free memory, else host RAM).
    kv_layout:         "split" (only the prefix persists; decode merges a prefix and a target attention) or
                       "joint" (the first release's layout, for comparison: every layer's target K/V persist too).
    parallel:          how a model loaded on several devices (Qwen21Pipeline.start_workers) uses them: "auto" (CFG
                       parallel at true_cfg_scale > 1 on two devices, else sequence parallel), "cfg" (one CFG branch
                       per device), "sequence" (image tokens and heads split over every device) or "off" (this
                       device alone). A model on one device ignores "auto". Same results within rounding.
    """

    prefix_cache: bool = True
    decode_graphs: bool = True
    compile_blocks: bool = False
    attention_backend: str = "auto"
    kv_cache: str = "bf16"
    kv_placement: str = "auto"
    kv_layout: str = "split"
    parallel: str = "auto"

    def __post_init__(self):
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.kv_cache not in KV_FORMATS:
            raise ValueError(f"kv_cache must be one of {KV_FORMATS}, got {self.kv_cache!r}")
        if self.kv_placement not in ("auto", *KV_PLACEMENTS):
            raise ValueError(f"kv_placement must be one of {('auto', *KV_PLACEMENTS)}, got {self.kv_placement!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")

    def kv_spec(self, placement: str) -> KVCacheSpec:
        """The cache spec with "auto" placement resolved to `placement`."""
        return KVCacheSpec(self.kv_cache, placement if self.kv_placement == "auto" else self.kv_placement,
                           self.kv_layout)  # fmt: skip

    def replace(self, **changes) -> SampleOptions:
        return dataclasses.replace(self, **changes)
