"""What every benchmark script shares: JSON-line output, device synchronisation, and the tests' diffusers
adapters (tests/dit_reference.py), so a benchmark calls the reference exactly as the parity tests do."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def emit(**fields):
    """One JSON line on stdout, flushed (the logs are read while a run is still going)."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_dit(config, device, dtype):
    """Our DiT with the benchmarks' random full-size initialisation, built on the meta device and filled where it
    runs: matrices normal with std 1/sqrt(3 fan_in) (the spread of torch's default Linear init, which the shared
    diffusers baseline used), norm weights 1, the zero-centred text norm 0."""
    from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer

    with torch.device("meta"):
        model = QwenImage21Transformer(config).to(dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("text_norm.weight"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0, (3 * param.shape[1]) ** -0.5, generator=gen)
    return model.eval()


def worker_dit(device, config, dtype, weights=None):
    """`random_dit` as a worker process builds it (parallel/recipes.py FunctionRecipe): the same weights on every
    device of a type (one seeded generator per device); weights: a quantised format for every block Linear."""
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    model = random_dit(config, device, dtype)
    if weights is not None:
        model.quantize_linears(uniform_plan(FORMATS[weights], config.num_layers))
    return model
