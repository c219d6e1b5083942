"""The example workflows: UI files reference only real node types, inputs and link types and turn into
the API files; every API file runs through the in-process runner on the tiny checkpoint and writes the
images it should (count, size, mode); the CLI exits non-zero on failure."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS
from qwen21_nodes.runner.cli import EXAMPLE_INPUTS, WORKFLOWS_DIR, ensure_tiny_models, run_workflow, tiny_overrides
from qwen21_nodes.runner.comfyui_only import NODES as COMFYUI_ONLY
from qwen21_nodes.runner.core_nodes import make_core_nodes
from qwen21_nodes.runner.graph import WorkflowError, find_node, load_prompt
from qwen21_nodes.runner.ui_format import check_ui_workflow, ui_to_api

API_WORKFLOWS = sorted((WORKFLOWS_DIR / "api").glob("*.json"))
UI_WORKFLOWS = sorted(WORKFLOWS_DIR.glob("*.json"))
EXPECTED = {
    "text_to_image", "edit_1_reference", "edit_4_references", "rgba_in_out", "turbo_schedule", "fast_vae_decode",
    "turbo_lora", "ksampler_text_to_image", "ksampler_edit_1_reference", "ksampler_lora", "control_canny",
    "inpaint", "ksampler_control",
}  # fmt: skip
KSAMPLER_WORKFLOWS = [p for p in API_WORKFLOWS if p.stem.startswith("ksampler_")]  # ComfyUI's KSampler: in ComfyUI
OUR_SAMPLER_WORKFLOWS = [p for p in API_WORKFLOWS if p not in KSAMPLER_WORKFLOWS]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models")


def node_classes():
    return {**COMFYUI_ONLY, **make_core_nodes(str(EXAMPLE_INPUTS), "", ""), **NODE_CLASS_MAPPINGS}


def test_every_workflow_exists_in_both_formats():
    assert {p.stem for p in API_WORKFLOWS} == EXPECTED
    assert {p.stem for p in UI_WORKFLOWS} == EXPECTED


def test_committed_files_match_the_build_description():
    spec = importlib.util.spec_from_file_location("workflows_build", WORKFLOWS_DIR / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    for path, content in build.render_workflows().items():
        assert json.loads(path.read_text()) == content, f"{path.name} is stale: run python workflows/build.py"
    for name, picture in build.input_images().items():
        with Image.open(EXAMPLE_INPUTS / name) as saved:
            assert saved.mode == picture.mode and saved.tobytes() == picture.tobytes(), name
    for path, (_picture, fingerprint) in build.render_thumbnails(build.render_workflows()).items():
        assert build.thumbnail_fingerprint(path) == fingerprint, f"{path.name} is stale: run python workflows/build.py"


def test_every_template_has_a_thumbnail():
    # ComfyUI's template browser shows workflows/<name>.jpg for workflows/<name>.json.
    assert {p.stem for p in WORKFLOWS_DIR.glob("*.jpg")} == {p.stem for p in UI_WORKFLOWS}
    for path in WORKFLOWS_DIR.glob("*.jpg"):
        with Image.open(path) as thumbnail:
            assert thumbnail.format == "JPEG" and thumbnail.size == (400, 400), path.name
            assert len(np.unique(np.asarray(thumbnail.convert("L")))) > 32, f"{path.name} is (nearly) blank"


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.stem for p in UI_WORKFLOWS])
def test_ui_workflow_is_valid_and_matches_its_api_version(path):
    ui = json.loads(path.read_text())
    assert check_ui_workflow(ui, node_classes()) == []
    assert ui_to_api(ui, node_classes()) == json.loads((WORKFLOWS_DIR / "api" / path.name).read_text())
    notes = [n for n in ui["nodes"] if n["type"] == "MarkdownNote"]
    assert notes and "models/" in notes[0]["widgets_values"][0], "needs a note saying which files go where"
    sampler = next(n for n in ui["nodes"] if n["type"] in ("Qwen21Sampler", "KSampler"))
    assert sampler["widgets_values"][1] in ("fixed", "randomize", "increment", "decrement")  # after the seed


@pytest.mark.parametrize("path", KSAMPLER_WORKFLOWS, ids=[p.stem for p in KSAMPLER_WORKFLOWS])
def test_the_runner_says_a_ksampler_workflow_needs_comfyui_before_running_anything(path, tiny_models, tmp_path):
    prompt = load_prompt(path.read_text())
    with pytest.raises(WorkflowError) as raised:
        run_workflow(path, models_dir=tiny_models, output_dir=tmp_path, overrides=tiny_overrides(prompt, tiny_models))
    message = str(raised.value)
    assert "KSampler is ComfyUI's own node" in message and "Run this workflow in ComfyUI" in message
    assert not any(tmp_path.rglob("*.png"))  # refused up front: nothing loaded or saved


@pytest.mark.parametrize("path", OUR_SAMPLER_WORKFLOWS, ids=[p.stem for p in OUR_SAMPLER_WORKFLOWS])
def test_api_workflow_runs_on_the_tiny_checkpoint(path, tiny_models, tmp_path):
    prompt = load_prompt(path.read_text())
    result = run_workflow(
        path, models_dir=tiny_models, output_dir=tmp_path, overrides=tiny_overrides(prompt, tiny_models)
    )
    saver = find_node(prompt, "Qwen21SaveImage")
    images = result.ui[saver]["images"]
    assert len(images) == prompt[find_node(prompt, "Qwen21Sampler")]["inputs"]["batch_size"]
    _conditioning, width, height, *_ = result.outputs[find_node(prompt, "Qwen21Encode")]
    rgba = any(node["class_type"] == "JoinImageWithAlpha" for node in prompt.values())
    for image in images:
        with Image.open(tmp_path / image["subfolder"] / image["filename"]) as picture:
            assert picture.size == (width, height)
            assert picture.mode == ("RGBA" if rgba else "RGB")
    stats = result.ui[find_node(prompt, "Qwen21Sampler")]["qwen21_stats"][0]
    assert stats["steps"] == 2 or prompt[find_node(prompt, "Qwen21Sampler")]["inputs"]["schedule"] == "turbo"


def run_cli(*args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "qwen21_nodes", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )


def test_cli_run_writes_images_and_fails_loudly(tiny_models, tmp_path):
    workflow = WORKFLOWS_DIR / "text_to_image.json"  # the UI format runs too
    overrides = tiny_overrides(load_prompt(ui_to_api(json.loads(workflow.read_text()), node_classes())), tiny_models)
    settings = [item for setting in overrides for item in ("--set", setting)]
    done = run_cli("run", str(workflow), "--models", str(tiny_models), "--output-dir", "out", *settings, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "qwen21" / "text_to_image_00001_.png").is_file()
    assert "sampling step" in done.stderr and "wrote" in done.stderr

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"1": {"class_type": "Qwen21Samplr", "inputs": {}}}))
    done = run_cli("run", str(broken), cwd=tmp_path)
    assert done.returncode == 1
    assert "unknown node type 'Qwen21Samplr'" in done.stderr


def test_cli_run_tiny_dir_runs_an_example_as_it_ships(tiny_models, tmp_path):
    """A newcomer without the weights: `run <example> --tiny-dir DIR` points the loaders at the tiny files (the turbo
    LoRA's included) without a guessed name; a UI file runs the same way, and --set still wins."""
    workflow = WORKFLOWS_DIR / "turbo_lora.json"
    done = run_cli("run", str(workflow), "--tiny-dir", str(tiny_models), "--output-dir", "out",
                   "--set", "Qwen21Encode.output_resolution=128", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    with Image.open(tmp_path / "out" / "qwen21" / "turbo_lora_00001_.png") as picture:
        assert picture.size == (128, 128)
    done = run_cli("run", str(workflow), "--tiny-dir", str(tiny_models), "--models", "models", cwd=tmp_path)
    assert done.returncode == 2 and "--tiny-dir and --models name two models folders" in done.stderr


def test_make_tiny_writes_the_api_workflows_pointed_at_the_tiny_files(tmp_path):
    """For POST /prompt to a ComfyUI whose models folder holds the tiny files: every example, each loader naming a
    tiny file that is there, and one of them run as written."""
    done = run_cli("make-tiny", "models", "--workflows", "tiny_workflows", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    written = sorted((tmp_path / "tiny_workflows").glob("*.json"))
    assert [p.name for p in written] == [p.name for p in API_WORKFLOWS]
    folders = {"diffusion_model": "diffusion_models", "text_encoder": "text_encoders", "vae": "vae",
               "lora_name": "loras", "folder": "diffusers"}  # fmt: skip
    for path in written:
        prompt = json.loads(path.read_text())
        named = [(folders[key], value) for node in prompt.values() for key, value in node["inputs"].items()
                 if key in folders and isinstance(value, str)]  # fmt: skip
        assert named and all((tmp_path / "models" / folder / name).exists() for folder, name in named), path.name
    result = run_workflow(tmp_path / "tiny_workflows" / "turbo_schedule.json", models_dir=tmp_path / "models",
                          output_dir=tmp_path / "out")  # fmt: skip
    assert any(ui.get("images") for ui in result.ui.values())


def test_demo_runs_on_a_tiny_checkpoint(tiny_models, tmp_path):
    done = run_cli("demo", "--tiny-dir", str(tiny_models), "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with Image.open(tmp_path / "out" / "qwen21" / "text_to_image_00001_.png") as picture:
        assert picture.size == (256, 256) and picture.mode == "RGB"


# A ComfyUI folder as the CLI sees it when run from there: `comfy` and `folder_paths` import (the folder is on
# sys.path), and comfy.model_management, as ComfyUI's does at import, sets up its device: without a GPU (and without
# ComfyUI's --cpu) that raises. The CLI is not a ComfyUI server and must never import it.
FAKE_COMFYUI = {
    "comfy/__init__.py": "",
    "comfy/model_management.py": "raise RuntimeError('Found no NVIDIA driver on your system.')\n",
    "comfy/model_patcher.py": "class ModelPatcher: ...\n",
    "comfy/utils.py": "class ProgressBar: ...\n",
    "folder_paths.py": "def get_folder_paths(kind): return []\n",
}


def fake_comfyui(root, model_management=None):
    for relative, text in FAKE_COMFYUI.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(model_management if model_management and relative.endswith("model_management.py") else text)
    return root


def test_the_cli_works_from_inside_a_comfyui_folder_without_a_gpu(tmp_path):
    comfyui = fake_comfyui(tmp_path / "ComfyUI")
    done = run_cli("make-tiny", "models", cwd=comfyui)
    assert done.returncode == 0, done.stderr
    assert "Found no NVIDIA driver" not in done.stderr
    assert (comfyui / "models" / "diffusion_models" / "qwen_image_2.1_tiny.safetensors").is_file()
    done = run_cli("demo", "--tiny-dir", "models", "--output-dir", "out", cwd=comfyui)
    assert done.returncode == 0, done.stderr
    assert (comfyui / "out" / "qwen21" / "text_to_image_00001_.png").is_file()


def test_comfyui_services_are_used_only_in_a_process_that_loaded_them(tmp_path):
    """In a ComfyUI server, comfy.model_management is loaded before custom nodes: then (and only then) the nodes
    use ComfyUI's devices, folders and memory manager."""
    comfyui = fake_comfyui(tmp_path / "ComfyUI", model_management="def get_torch_device(): return 'comfy-device'\n")
    probe = "import {first}; from qwen21_nodes.nodes import host; print(host.IN_COMFYUI, host.comfy_mm is not None)"
    outside = subprocess.run([sys.executable, "-c", probe.format(first="os")], cwd=comfyui, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    inside = subprocess.run([sys.executable, "-c", probe.format(first="comfy.model_management")], cwd=comfyui,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert outside.returncode == 0 and inside.returncode == 0, outside.stderr + inside.stderr
    assert outside.stdout.split() == ["False", "False"] and inside.stdout.split() == ["True", "True"]


@pytest.mark.comfyui
@pytest.mark.skipif(
    not (os.environ.get("COMFYUI_DIR") and os.path.isfile(os.path.join(os.environ["COMFYUI_DIR"], "main.py"))),
    reason="set COMFYUI_DIR to a ComfyUI checkout (and COMFYUI_PYTHON to its interpreter) to run make-tiny in it",
)
def test_make_tiny_runs_inside_a_real_comfyui_folder(tmp_path):
    import qwen21_nodes

    comfyui = os.environ["COMFYUI_DIR"]
    python = os.environ.get("COMFYUI_PYTHON") or sys.executable
    # the package importable by its name whatever its checkout's folder is called (custom_nodes/qwen21_nodes in
    # ComfyUI; a clone may be named otherwise)
    package_parent = tmp_path / "packages"
    package_parent.mkdir()
    (package_parent / "qwen21_nodes").symlink_to(os.path.dirname(os.path.abspath(qwen21_nodes.__file__)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(package_parent), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([python, "-m", "qwen21_nodes", "make-tiny", str(tmp_path / "models")], cwd=comfyui,
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "models" / "vae" / "qwen_image_2.1_vae_tiny.safetensors").is_file()


def test_the_tiny_files_are_picked_by_name_beside_other_models(tmp_path):
    """`qwen21-nodes demo --tiny-dir models` from a ComfyUI folder: the models folders hold the user's own files too;
    the tiny ones are found by their names (a folder without them says how to make them)."""
    from qwen21_nodes.qwen21_core.tiny import NAMES

    models = ensure_tiny_models(tmp_path / "models")
    for kind in ("diffusion_models", "text_encoders", "vae", "loras"):
        (models / kind / "someone_elses.safetensors").write_bytes(b"")
    prompt = load_prompt(json.loads((WORKFLOWS_DIR / "api" / "turbo_lora.json").read_text()))
    settings = tiny_overrides(prompt, models)
    assert any(Path(NAMES["lora"]).name in setting for setting in settings)
    assert not any("someone_elses" in setting for setting in settings)
    (models / NAMES["transformer"]).unlink()
    with pytest.raises(FileNotFoundError, match="make-tiny"):
        tiny_overrides(load_prompt(json.loads((WORKFLOWS_DIR / "api" / "text_to_image.json").read_text())), models)
