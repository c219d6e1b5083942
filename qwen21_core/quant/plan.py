"""Which Linears of a model are quantised, and in what format: from the user's choice and the file's own format.

Choices (the loaders' `weight_format` / `text_encoder_format`):
- "auto":  keep what the file stores: its quantised layers stay quantised in their format (int8_convrot files
           run as int8_convrot, fp8_scaled as fp8), its float layers stay float;
- "none":  dequantise everything to the compute dtype (bf16 on a GPU);
- "fp8", "int8", "int8_convrot": quantise the model's quantisable Linears into that format at load time
           (from float weights, or requantised from a file in another format), except the layers kept.
The DiT's quantisable Linears are the four block projections (dit/transformer.py QUANTIZABLE); embeddings,
modulation, norm_out and proj_out always stay in the compute dtype. The text encoder's are the Linears of its
language-model decoder layers (its vision tower stays in the compute dtype unless the file quantised it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .weights import FORMATS, QuantFormat

CHOICES = ("auto", "none", *FORMATS)


@dataclass(frozen=True)
class WeightFormats:
    """What the loaders do with weights; one object instead of a keyword per option at every layer.

    dit / text_encoder: one of CHOICES (see the module docstring).
    keep: DiT block paths (e.g. "img_mlp.gate_up", "img_mlp.out") kept in the compute dtype under an explicit
          format: the measured sensitivity table in BENCHMARKS.md says which ones are worth it.
    """

    dit: str = "auto"
    text_encoder: str = "auto"
    keep: tuple[str, ...] = ()

    def __post_init__(self):
        for name, value in (("dit", self.dit), ("text_encoder", self.text_encoder)):
            if value not in CHOICES:
                raise ValueError(f"{name} weight format must be one of {CHOICES}, got {value!r}")


def choose(choice: str, candidates: Iterable, stored: Mapping, keep: Iterable = ()) -> dict:
    """name -> QuantFormat for each candidate layer to quantise.

    candidates: every quantisable layer name; stored: name -> QuantFormat of the layers the file quantised.
    """
    if choice == "none":
        return {}
    if choice == "auto":
        return {name: stored[name] for name in candidates if name in stored}
    fmt = FORMATS[choice]
    keep = set(keep)
    return {name: fmt for name in candidates if _path(name) not in keep}


def _path(name):
    """A DiT layer is named (block index, path): `keep` lists paths; other layers are named by a string."""
    return name[1] if isinstance(name, tuple) else name


# ---- the DiT ---------------------------------------------------------------------------------------------

# diffusers names of the block weights -> the fused layer that holds them (dit/transformer.py checkpoint_slots)
_DIT_LAYER_OF = {
    "attn.to_q": "attn.to_qkv",
    "attn.to_k": "attn.to_qkv",
    "attn.to_v": "attn.to_qkv",
    "attn.to_out.0": "attn.to_out",
    "img_mlp.gate_layer": "img_mlp.gate_up",
    "img_mlp.proj": "img_mlp.gate_up",
    "img_mlp.out": "img_mlp.out",
}


def dit_stored_formats(diffusers_names: Mapping[str, QuantFormat], stack: str = "transformer_blocks",
                       extra: Mapping[str, str] | None = None) -> dict[tuple[int, str], QuantFormat]:  # fmt: skip
    """(block, fused layer path) -> format, from the quantised weights' diffusers names; `stack`: the blocks' name
    ("control_blocks" for the Fun-Control branch, whose blocks are the DiT's); `extra`: more per-block layers of that
    stack (file name after the block index -> plan path: the branch's skips)."""
    layer_of = {**_DIT_LAYER_OF, **(extra or {})}
    pattern = re.compile(rf"{re.escape(stack)}\.(\d+)\.(.+)\.weight")
    out = {}
    for name, fmt in diffusers_names.items():
        match = pattern.fullmatch(name)
        if match and match.group(2) in layer_of:
            out[(int(match.group(1)), layer_of[match.group(2)])] = fmt
    return out
