"""How a worker builds the same DiT as rank 0: from the same checkpoint file (same dtype and weight formats, so the
same quantisation), or from a function (tests and benchmarks build their models in memory, deterministically).

A recipe travels to the worker pickled, so it names its function by module: a function of this package, or of a
module the worker can import (the worker's import path is rank 0's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..dit.transformer import QwenImage21Transformer
from ..quant.plan import WeightFormats


@dataclass(frozen=True)
class FileRecipe:
    """The DiT from a checkpoint (a diffusers transformer folder or a single file), as the loader read it."""

    path: str
    dtype: torch.dtype
    weight_formats: WeightFormats = field(default_factory=WeightFormats)

    def build(self, device: torch.device) -> QwenImage21Transformer:
        from ..checkpoints.loading import load_transformer

        path = Path(self.path)
        if path.name.endswith(".index.json"):  # a sharded diffusers transformer: load its folder
            path = path.parent
        transformer, _ = load_transformer(path, device, self.dtype, None, self.weight_formats)
        return transformer.eval()

    @property
    def source_path(self) -> str | None:
        """Where a LoRA merge re-reads original weights from (lora/merge.py FileOriginals)."""
        return self.path


def recipe_for(sources: dict, dtype: torch.dtype, weight_formats: WeightFormats) -> FileRecipe:
    """The recipe of the DiT a pipeline loaded (`sources`: its loading record), in the same dtype and formats."""
    path = sources.get("transformer", {}).get("path")
    if not path:
        raise ValueError("this pipeline's DiT was not loaded from a file: pass start_workers a recipe that builds the "
                         "same DiT (parallel/recipes.py FunctionRecipe)")  # fmt: skip
    return FileRecipe(str(path), dtype, weight_formats)


@dataclass(frozen=True)
class FunctionRecipe:
    """`function(device, *args, **kwargs)` -> the DiT; the function must be deterministic."""

    function: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def build(self, device: torch.device) -> QwenImage21Transformer:
        return self.function(torch.device(device), *self.args, **self.kwargs).eval()

    @property
    def source_path(self) -> str | None:
        return None


def tiny_transformer(device, seed: int = 0, dtype: torch.dtype = torch.float32,
                     weights: str | None = None) -> QwenImage21Transformer:  # fmt: skip
    """The tiny test DiT (qwen21_core/tiny.py) with the weights `make_tiny(seed=seed)` writes, built in memory;
    weights: a quantised format for every block Linear (quant/weights.py FORMATS), None to keep `dtype`."""
    from ..dit.transformer import uniform_plan
    from ..quant.weights import FORMATS
    from ..tiny import TINY_TRANSFORMER, tiny_transformer_state_dict

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        state = tiny_transformer_state_dict()
    model = QwenImage21Transformer(TINY_TRANSFORMER)
    model.load_diffusers_state_dict(state)
    model = model.to(device=device, dtype=dtype)
    if weights is not None:
        model.quantize_linears(uniform_plan(FORMATS[weights], TINY_TRANSFORMER.num_layers))
    return model.eval()
