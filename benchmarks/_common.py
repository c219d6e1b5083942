"""What every benchmark script shares: JSON-line output, device synchronisation, and the tests' diffusers
adapters (tests/dit_reference.py), so a benchmark calls the reference exactly as the parity tests do."""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def emit(**fields):
    """One JSON line on stdout, flushed (the logs are read while a run is still going)."""
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_call_ms(fn, device, iters: int, warmup: int = 1) -> float:
    """Mean ms of `fn` over `iters` back-to-back calls, after `warmup` calls (synchronised before and after: the
    launches queue as in a model's forward, so short kernels are not timed with a sync each)."""
    for _ in range(warmup):
        fn()
    sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - started) / iters * 1e3


def random_dit(config, device, dtype):
    """Our DiT with the benchmarks' random full-size initialisation, built on the meta device and filled where it
    runs: matrices normal with std 1/sqrt(3 fan_in) (the spread of torch's default Linear init, which the shared
    diffusers baseline used), norm weights 1, the zero-centred text norm 0."""
    from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer

    with torch.device("meta"):
        model = QwenImage21Transformer(config).to(dtype)
    return random_weights(model, device, seed=0)


def random_weights(model, device, seed: int):
    """`model` (built on the meta device) filled on `device` as the benchmarks fill every model: matrices normal with
    std 1/sqrt(3 fan_in), vectors 1, a zero-centred text norm 0. Returns it in eval mode."""
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("text_norm.weight"):
                param.zero_()
            elif param.ndim == 1:
                param.fill_(1.0)
            else:
                param.normal_(0, (3 * param.shape[1]) ** -0.5, generator=gen)
    return model.eval()


def add_sampling_arguments(parser, sizes: str, steps: int) -> None:
    """The options the sampling benchmarks share: device, tiny model, sizes, steps, warm-ups, prompt length, weights."""
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--sizes", default=sizes)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmups", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--weights", default="fp8", choices=["bf16", "fp8", "int8", "int8_convrot"])


def worker_dit(device, config, dtype, weights=None):
    """`random_dit` as a worker process builds it (parallel/recipes.py FunctionRecipe): the same weights on every
    device of a type (one seeded generator per device); weights: a quantised format for every block Linear."""
    from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS

    model = random_dit(config, device, dtype)
    if weights is not None:
        model.quantize_linears(uniform_plan(FORMATS[weights], config.num_layers))
    return model


def pipeline_without_encoders(transformer, device):
    """A Qwen21Pipeline around `transformer` alone, for benchmarks of the sampling loop: no text encoder, and a VAE
    stand-in that only says where the VAE is and normalises latents with mean 0, std 1."""
    from qwen21_nodes.qwen21_core.config import SchedulerConfig
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline

    channels = transformer.config.in_channels
    vae = torch.nn.Module()
    vae.anchor = torch.nn.Parameter(torch.zeros(1, device=device), requires_grad=False)  # where the VAE "is"
    vae.config = SimpleNamespace(latents_mean=[0.0] * channels, latents_std=[1.0] * channels)
    return Qwen21Pipeline(transformer, vae, None, SchedulerConfig())


def prompt_conditioning(config, tokens: int, label: str):
    """A random prompt of `tokens` text tokens (seeded by its length), with a content hash naming `label`."""
    from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding

    embeds = torch.randn(tokens, config.context_in_dim, generator=torch.Generator().manual_seed(tokens))
    return Conditioning(PromptEmbedding(embeds, torch.zeros(tokens, dtype=torch.bool)), content_hash=f"bench:{label}")
