"""Configuration of every component, read from the checkpoint's JSON files.

Defaults are the released Qwen-Image-2.1 values (diffusers 0.42.1 class defaults). `from_dict` accepts
a diffusers `config.json` as it is: bookkeeping keys (`_class_name`, `_diffusers_version`, ...) are
ignored, unknown real keys are an error so a wrong file is caught early.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _read_fields(cls, data: dict[str, Any], what: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    values, unknown = {}, []
    for key, value in data.items():
        if key.startswith("_"):
            continue
        if key in names:
            values[key] = tuple(value) if isinstance(value, list) else value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(
            f"{what} config has keys this pack does not know: {sorted(unknown)}. "
            f"Expected a Qwen-Image-2.1 {what} config with keys among {sorted(names)}."
        )
    return values


class _JsonConfig:
    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        return cls(**_read_fields(cls, data, cls._what))

    @classmethod
    def from_json_file(cls, path: str | Path):
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class TransformerConfig(_JsonConfig):
    _what = "transformer"

    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = 64
    num_layers: int = 32
    attention_head_dim: int = 128
    num_attention_heads: int = 32
    context_in_dim: int = 4096
    mlp_ratio: int = 3
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    eps: float = 1e-6
    causal_condition: bool = True

    def __post_init__(self):
        if self.patch_size != 1:
            raise ValueError(f"transformer config: patch_size must be 1 for Qwen-Image-2.1, got {self.patch_size}")
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(
                f"transformer config: axes_dims_rope {list(self.axes_dims_rope)} must add up to "
                f"attention_head_dim {self.attention_head_dim}"
            )
        if any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"transformer config: axes_dims_rope {list(self.axes_dims_rope)} must all be even")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        return self.inner_dim * self.mlp_ratio

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels


_LATENTS_MEAN = (
    0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722, 1.8873, -1.7177, -0.651, 0.2732,
    0.7562, -0.6163, -1.0277, 3.8363, 2.021, 0.0472, 0.932, 2.0087, 2.4954, -0.1391, -1.4249, 1.8464,
    -0.5236, 1.2826, 3.7046, -1.3035, 2.7286, -1.4518, -1.9036, -1.9955, -0.0342, -1.0265, -0.7636, 3.0555,
    0.0746, -3.0751, -0.1076, 1.7376, -1.0914, -1.9435, -0.2784, -1.368, 0.4809, -0.4433, 0.3764, 0.5729,
    -2.0595, 1.096, -1.326, -2.0211, -5.0179, 0.5275, 4.0162, 1.8505, 0.3026, 1.9373, 1.4937, 0.2632,
    0.5547, -1.7121, -0.1562, 0.0304,
)  # fmt: skip
_LATENTS_STD = (
    3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.791, 3.0785, 3.65, 3.9308, 3.0904, 2.8778,
    3.7675, 3.732, 5.0756, 3.2864, 4.0397, 3.1317, 4.0443, 2.9249, 3.9454, 3.0988, 4.2489, 3.4896, 3.8513,
    3.9323, 3.4719, 3.7498, 4.283, 3.5694, 4.2467, 3.9037, 3.2947, 5.077, 3.5075, 3.27, 3.4767, 2.8063,
    5.1125, 3.5327, 4.7833, 3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875, 3.9624, 4.0168, 3.5643, 4.055,
    5.5614, 4.2963, 4.408, 3.4959, 3.8747, 3.7608, 3.5735, 3.149, 3.7662, 3.6746, 3.4563, 3.8161,
)  # fmt: skip


@dataclass(frozen=True)
class VAEConfig(_JsonConfig):
    _what = "VAE"

    base_dim: int = 96
    decoder_base_dim: int | None = 144
    z_dim: int = 64
    dim_mult: tuple[int, ...] = (1, 2, 4, 8, 8)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True, True)
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = _LATENTS_MEAN
    latents_std: tuple[float, ...] = _LATENTS_STD
    is_residual: bool = True
    in_channels: int = 4
    out_channels: int = 4
    patch_size: int | None = None
    scale_factor_temporal: int = 8
    scale_factor_spatial: int = 16

    def __post_init__(self):
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(
                f"VAE config: latents_mean/latents_std need z_dim={self.z_dim} entries, "
                f"got {len(self.latents_mean)}/{len(self.latents_std)}"
            )

    @property
    def spatial_compression(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)


@dataclass(frozen=True)
class SchedulerConfig(_JsonConfig):
    """FlowMatchEulerDiscreteScheduler settings that matter for sampling."""

    _what = "scheduler"

    num_train_timesteps: int = 1000
    shift: float = 1.0
    use_dynamic_shifting: bool = False
    base_shift: float | None = 0.5
    max_shift: float | None = 1.15
    base_image_seq_len: int | None = 256
    max_image_seq_len: int | None = 4096
    invert_sigmas: bool = False
    shift_terminal: float | None = None
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    time_shift_type: str = "exponential"
    stochastic_sampling: bool = False

    def __post_init__(self):
        unsupported = [
            name
            for name in ("invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                         "stochastic_sampling")
            if getattr(self, name)
        ]  # fmt: skip
        if unsupported:
            raise ValueError(f"scheduler config: {unsupported} are not supported for Qwen-Image-2.1 (set them false)")
        if self.time_shift_type not in ("exponential", "linear"):
            raise ValueError(
                f"scheduler config: time_shift_type must be 'exponential' or 'linear', got {self.time_shift_type!r}"
            )
        base = 256 if self.base_image_seq_len is None else self.base_image_seq_len
        longest = 4096 if self.max_image_seq_len is None else self.max_image_seq_len
        if self.use_dynamic_shifting and base == longest:  # the shift is a line through two lengths
            raise ValueError(f"scheduler config: base_image_seq_len and max_image_seq_len must differ for dynamic "
                             f"shifting, both are {base}")  # fmt: skip


# The released checkpoint's scheduler_config.json, written down so the Scheduler node has it without a model.
QWEN21_SCHEDULER = SchedulerConfig(
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
)


@dataclass(frozen=True)
class PipelineConfig:
    """What model_index.json adds beyond the components: the turbo sampling grid."""

    sample_sigmas: tuple[float, ...] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
