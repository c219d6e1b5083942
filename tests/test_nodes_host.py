"""The ComfyUI adapter's plain fallbacks (no ComfyUI here), the preview projection and sigma parsing."""

import logging

import pytest
import torch
from qwen21_nodes.nodes import host, memory_adapter
from qwen21_nodes.nodes.preview import fit_latent_rgb, latent_to_preview
from qwen21_nodes.nodes.sample import parse_sigmas


@pytest.fixture
def models_dir(tmp_path):
    for relative in (
        "diffusion_models/qwen_image_2.1_bf16.safetensors",
        "diffusion_models/sub/other.safetensors",
        "diffusion_models/notes.txt",
        "text_encoders/qwen3vl_8b_bf16.safetensors",
        "diffusers/Qwen-Image-2.1/model_index.json",
        "diffusers/Qwen-Image-2.1/transformer/config.json",
        "diffusers/not_a_pipeline/readme.md",
    ):
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    host.set_models_dir(tmp_path)
    yield tmp_path
    host.set_models_dir(None)


def test_runs_without_comfyui():
    assert not host.IN_COMFYUI
    assert host.intermediate_device() == torch.device("cpu")


def test_model_files_are_found_under_the_models_dir(models_dir):
    assert host.list_weight_files("diffusion_models") == ["qwen_image_2.1_bf16.safetensors", "sub/other.safetensors"]
    assert host.list_weight_files("vae") == []
    assert host.weight_file_path("diffusion_models", "sub/other.safetensors") == str(
        models_dir / "diffusion_models" / "sub" / "other.safetensors"
    )
    assert host.list_diffusers_folders() == ["Qwen-Image-2.1"]
    assert host.diffusers_folder_path("Qwen-Image-2.1") == str(models_dir / "diffusers" / "Qwen-Image-2.1")


def test_missing_model_file_error_says_where_it_looked(models_dir):
    with pytest.raises(FileNotFoundError, match=r"'missing.safetensors' not found in the vae folder"):
        host.weight_file_path("vae", "missing.safetensors")
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        host.diffusers_folder_path("not_a_pipeline")
    with pytest.raises(ValueError, match="must be one of"):
        host.model_folders("checkpoints")


def test_loader_and_lora_nodes_watch_their_files(models_dir):
    """IS_CHANGED (what ComfyUI's output cache and the runner's compare) follows a file replaced under its name."""
    import os

    from qwen21_nodes.nodes.loader import Qwen21DiffusersLoader, Qwen21ModelLoader
    from qwen21_nodes.nodes.lora import Qwen21LoraLoader

    (models_dir / "vae").mkdir()
    (models_dir / "vae" / "v.safetensors").write_text("{}")
    (models_dir / "loras").mkdir()
    lora = models_dir / "loras" / "l.safetensors"
    lora.write_text("{}")
    files = dict(diffusion_model="sub/other.safetensors", text_encoder="qwen3vl_8b_bf16.safetensors",
                 vae="v.safetensors", weight_dtype="auto")  # fmt: skip

    def states():
        return (Qwen21ModelLoader.IS_CHANGED(**files),
                Qwen21DiffusersLoader.IS_CHANGED(folder="Qwen-Image-2.1", device="auto"),
                Qwen21LoraLoader.IS_CHANGED(lora_name="l.safetensors", strength=1.0))  # fmt: skip

    before = states()
    assert states() == before
    lora.write_text("{ }")  # another size
    (models_dir / "diffusion_models" / "sub" / "other.safetensors").write_text("{ }")
    config = models_dir / "diffusers" / "Qwen-Image-2.1" / "transformer" / "config.json"
    os.utime(config, ns=(0, config.stat().st_mtime_ns + 10**9))  # same size, another modification time
    after = states()
    assert all(a != b for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../etc/passwd", "sub/../../outside.safetensors", "..",
                                  "", "a\x00b", "C:\\Windows\\x.safetensors", "..\\x.safetensors"])  # fmt: skip
def test_model_names_stay_inside_their_folders(models_dir, name):
    """A name that arrives through a link (a third-party node, the runner) skips ComfyUI's list check: absolute
    names and '..' are refused before any file is looked at, for weight files, LoRAs, diffusers folders and the
    loaders' IS_CHANGED (which would otherwise stat any file)."""
    from qwen21_nodes.nodes.loader import Qwen21DiffusersLoader
    from qwen21_nodes.nodes.lora import Qwen21LoraLoader

    (models_dir.parent / "outside.safetensors").write_text("{}")
    for call in (lambda: host.weight_file_path("diffusion_models", name), lambda: host.diffusers_folder_path(name),
                 lambda: host.weight_file_path("loras", name),
                 lambda: Qwen21LoraLoader.IS_CHANGED(lora_name=name, strength=1.0),
                 lambda: Qwen21DiffusersLoader.IS_CHANGED(folder=name, device="auto")):  # fmt: skip
        with pytest.raises(ValueError, match="must be a relative path inside"):
            call()


def test_a_link_placed_inside_a_model_folder_is_followed(models_dir, tmp_path_factory):
    """Where a name leads is decided by the name, lexically: a symlink the user put inside a model folder (a file or
    a folder kept on another disk) is a normal setup and loads."""
    elsewhere = tmp_path_factory.mktemp("other_disk")
    (elsewhere / "big.safetensors").write_text("{}")
    (elsewhere / "pipeline").mkdir()
    (elsewhere / "pipeline" / "model_index.json").write_text("{}")
    (models_dir / "diffusion_models" / "big.safetensors").symlink_to(elsewhere / "big.safetensors")
    (models_dir / "diffusers" / "linked").symlink_to(elsewhere / "pipeline", target_is_directory=True)
    assert host.weight_file_path("diffusion_models", "big.safetensors") == str(
        models_dir / "diffusion_models" / "big.safetensors"
    )
    assert host.diffusers_folder_path("linked") == str(models_dir / "diffusers" / "linked")
    assert "big.safetensors" in host.list_weight_files("diffusion_models")
    assert "linked" in host.list_diffusers_folders()


def test_inside_comfyui_names_go_through_folder_paths(monkeypatch):
    """Inside ComfyUI the file is found by folder_paths.get_full_path (its folders, extra_model_paths.yaml), after
    the same name check."""
    asked = []

    class FolderPaths:
        @staticmethod
        def get_full_path(kind, name):
            asked.append((kind, name))
            return f"/comfy/models/{kind}/{name}" if name.startswith("ok") else None

        @staticmethod
        def get_folder_paths(kind):
            return [f"/comfy/models/{kind}"]

    monkeypatch.setattr(host, "IN_COMFYUI", True)
    monkeypatch.setattr(host, "comfy_folder_paths", FolderPaths)
    assert host.weight_file_path("loras", "ok/l.safetensors") == "/comfy/models/loras/ok/l.safetensors"
    assert host.diffusers_folder_path("ok_pipe") == "/comfy/models/diffusers/ok_pipe"
    with pytest.raises(FileNotFoundError, match="'missing.safetensors' not found"):
        host.weight_file_path("loras", "missing.safetensors")
    with pytest.raises(ValueError, match="must be a relative path inside"):
        host.weight_file_path("loras", "../ok.safetensors")
    assert asked == [("loras", "ok/l.safetensors"), ("diffusers", "ok_pipe/model_index.json"),
                     ("loras", "missing.safetensors")]  # fmt: skip


_CHILD_LISTING = """
import json, sys
from qwen21_nodes.nodes import host
host.set_models_dir(sys.argv[1])
print(json.dumps([host.list_weight_files("diffusion_models"), host.list_diffusers_folders(),
                  host.file_identity(host.diffusers_folder_path("Qwen-Image-2.1")).count(chr(10)) + 1]))
"""


def test_folder_walks_end_quickly_on_symlink_loops(models_dir):
    """Two links back up the tree in each folder made the listing (it runs on every /object_info) walk for minutes:
    every walk remembers the real folders it has been in. In a child process, so a regression cannot hang the run."""
    import json
    import subprocess
    import sys
    import time

    for link, target in (("diffusion_models/loop", "."), ("diffusion_models/sub/up", ".."), ("diffusers/loop", "."),
                         ("diffusers/Qwen-Image-2.1/transformer/up", ".."),
                         ("diffusers/Qwen-Image-2.1/transformer/loop", ".")):  # fmt: skip
        (models_dir / link).symlink_to(target, target_is_directory=True)
    started = time.perf_counter()
    child = subprocess.run([sys.executable, "-P", "-c", _CHILD_LISTING, str(models_dir)], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    weights, pipelines, identity_lines = json.loads(child.stdout.strip().splitlines()[-1])
    assert weights == ["qwen_image_2.1_bf16.safetensors", "sub/other.safetensors"]
    assert pipelines == ["Qwen-Image-2.1"]
    assert identity_lines == 2  # model_index.json and transformer/config.json, each once
    assert time.perf_counter() - started < 60


def test_no_models_dir_means_no_files():
    host.set_models_dir(None)
    assert host.model_folders("vae") == [] and host.list_weight_files("vae") == []


def test_interrupt_flag_stops_progress_once(caplog):
    progress = host.Progress(3, "step")
    with caplog.at_level(logging.INFO, logger=host.__name__):
        progress.update(1)
    assert "step 1/3" in caplog.text
    host.request_interrupt()
    with pytest.raises(host.Interrupted):
        progress.update(2)
    progress.update(2)  # the request was consumed: the next run is not interrupted


def test_outside_comfyui_the_local_manager_places_and_releases():
    """Outside ComfyUI our own manager (memory/manager.py) places the modules: nothing to do for a CPU device at
    load; an explicit unload moves them to the offload device and releases what hangs off them."""
    layer = torch.nn.Linear(2, 2)
    released = []
    managed = memory_adapter.ManagedModules({"layer": layer}, torch.device("cpu"), on_unload=lambda: released.append(1))
    managed.load(10**12)
    assert managed.patcher is None and released == [] and managed not in memory_adapter.LOCAL.loaded
    managed.unload()
    assert released == [1]
    assert layer.weight.device.type == "cpu"


def test_preview_fit_recovers_a_linear_latent_space():
    # A stand-in "VAE": each latent token is a fixed linear function of its 16x16 patch's mean colour.
    generator = torch.Generator().manual_seed(1)
    mixing, offset = torch.randn(3, 64, generator=generator), torch.randn(64, generator=generator)

    def encode(images):  # [B, H, W, 3] in 0..1 -> [B, 64, H/16, W/16]
        mean = torch.nn.functional.avg_pool2d(images.permute(0, 3, 1, 2) * 2 - 1, 16)
        return torch.einsum("bkhw,kc->bchw", mean, mixing) + offset[None, :, None, None]

    factors, bias = fit_latent_rgb(encode)
    assert factors.shape == (64, 3) and bias.shape == (3,)
    colours = torch.rand(1, 32, 48, 3)
    latents = encode(colours)
    expected = torch.nn.functional.avg_pool2d(colours.permute(0, 3, 1, 2) * 2 - 1, 16)[0].permute(1, 2, 0)
    recovered = torch.einsum("chw,cr->hwr", latents[0], factors) + bias
    assert torch.allclose(recovered, expected, atol=1e-3)
    preview = latent_to_preview(latents, factors, bias)
    assert preview.size == (3, 2) and preview.mode == "RGB"


@pytest.mark.parametrize(
    "text, expected",
    [("1.0, 0.5, 0", [1.0, 0.5]), ("0.9\n0.3,\n0.1", [0.9, 0.3, 0.1]), ("1", [1.0])],
)
def test_custom_sigmas_parse(text, expected):
    assert parse_sigmas(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("1.0, x", "comma-separated numbers"),
        ("0", "at least one value"),
        ("1.0, 0.5, 0.7", "strictly"),
        ("1.5, 0.5", "within"),
        ("0.5, -0.1", "within"),
        ("", "at least one value"),
    ],
)
def test_bad_custom_sigmas_name_the_input(text, message):
    with pytest.raises(ValueError, match=message) as caught:
        parse_sigmas(text)
    assert "sigmas" in str(caught.value)


def test_a_link_loop_is_an_identity_not_an_error(tmp_path):
    """IS_CHANGED of a loader runs on every queued prompt: a model folder holding a symlink loop must not raise there
    (the load itself names what it cannot read)."""
    folder = tmp_path / "diffusers" / "model"
    folder.mkdir(parents=True)
    (folder / "loop").symlink_to(folder / "loop")
    assert "unreadable" in host.file_identity(str(folder / "loop"))
    assert "unreadable" in host.file_identity(str(folder))
