"""How a generation runs (not what it makes): one small object that travels from the sampler node through
the model handle and the pipeline to the sampler, instead of a keyword argument per option at every layer.

Defaults are the exact path; every field that changes numerics says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .dit.attention import BACKENDS as ATTENTION_BACKENDS


@dataclass(frozen=True)
class SampleOptions:
    """prefix_cache:      cache the text/condition prefix K/V after step 1 (False recomputes it every step,
                          for checking; identical results, slower).
    decode_graphs:     replay decode steps from CUDA graphs (CUDA only; bit-identical to eager decode).
    compile_blocks:    regional torch.compile of the bf16 block math (opt-in; not bit-identical).
    attention_backend: SDPA backend, one of ATTENTION_BACKENDS ("auto" lets torch choose).
    """

    prefix_cache: bool = True
    decode_graphs: bool = True
    compile_blocks: bool = False
    attention_backend: str = "auto"

    def __post_init__(self):
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")

    def replace(self, **changes) -> SampleOptions:
        return dataclasses.replace(self, **changes)
