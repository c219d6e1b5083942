"""tiny.py: make_tiny writes both layouts, diffusers' own pipeline loads the folder, images are not degenerate."""

import hashlib
import json

import pytest
import torch
from qwen21_nodes.qwen21_core.tiny import MODEL_INDEX, TURBO_SIGMAS, make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_writes_both_layouts_in_a_few_megabytes(tiny):
    root = tiny["models"]
    for role in ("transformer", "vae", "text_encoder"):
        assert tiny[role].is_file() and tiny[role].parent.parent == root
    assert (tiny["tokenizer"] / "tokenizer.json").is_file()
    folder = tiny["diffusers"]
    for name in ("model_index.json", "transformer/config.json", "vae/config.json", "text_encoder/config.json",
                 "scheduler/scheduler_config.json", "processor/tokenizer.json",
                 "transformer/diffusion_pytorch_model.safetensors.index.json"):  # fmt: skip
        assert (folder / name).is_file(), name
    assert len(list((folder / "transformer").glob("*.safetensors"))) == 2  # sharded, like the release
    assert json.loads((folder / "model_index.json").read_text()) == MODEL_INDEX
    turbo_index = json.loads((tiny["diffusers_turbo"] / "model_index.json").read_text())
    assert turbo_index["sample_sigmas"] == list(TURBO_SIGMAS)
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert total < 10 * 2**20, f"tiny set is {total / 2**20:.1f} MiB"


def test_same_seed_same_files_other_seed_other_weights(tiny, tmp_path):
    again = make_tiny(tmp_path / "again", seed=0)
    for role in ("transformer", "vae", "text_encoder"):
        assert _digest(again[role]) == _digest(tiny[role]), role
    other = make_tiny(tmp_path / "other", seed=1)
    for role in ("transformer", "vae", "text_encoder"):
        assert _digest(other[role]) != _digest(tiny[role]), role


def test_norm_weights_are_not_trivial(tiny):
    from safetensors.torch import load_file

    dit = load_file(tiny["transformer"])
    text_norm = dit["model.diffusion_model.txt_in.text_norm.weight"]
    norm_q = dit["model.diffusion_model.transformer_blocks.0.attn.norm_q.weight"]
    assert text_norm.abs().mean() > 0.01 and (norm_q - 1).abs().mean() > 0.01
    gamma = load_file(tiny["vae"])["decoder.head.0.gamma"]
    assert (gamma - 1).abs().mean() > 0.01


def test_diffusers_loads_the_folder_and_generates(tiny):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(tiny["diffusers_turbo"])
    assert list(pipe.config.sample_sigmas) == list(TURBO_SIGMAS)
    assert pipe.scheduler.config.shift_terminal == 0.02
    image = pipe(prompt="A capybara", height=64, width=64, sigmas=[1.0, 0.5], output_type="pt",
                 generator=torch.Generator().manual_seed(0)).images  # fmt: skip
    assert image.shape == (1, 4, 64, 64)
    assert torch.isfinite(image).all() and image.std() > 0.02
    assert 0.05 < image.mean() < 0.95


def test_our_pipeline_gives_the_same_image_from_both_layouts(tiny):
    from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline

    images = []
    for source in (tiny["diffusers"], {k: tiny[k] for k in ("transformer", "vae", "text_encoder")}):
        pipe = Qwen21Pipeline.from_pretrained(source, device="cpu", dtype=torch.float32)
        cond = pipe.encode("A capybara", output_resolution=64)
        images.append(pipe.decode(pipe.sample(cond, steps=2, seed=0)))
    assert images[0].shape == (1, 64, 64, 4)
    assert torch.isfinite(images[0]).all() and images[0].std() > 0.02
    assert torch.equal(images[0], images[1])


def test_cli_make_tiny(tmp_path):
    from qwen21_nodes.runner.cli import main

    assert main(["make-tiny", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "diffusion_models" / "qwen_image_2.1_tiny.safetensors").is_file()
    assert (tmp_path / "cli" / "diffusers" / "qwen_image_2.1_tiny" / "model_index.json").is_file()
