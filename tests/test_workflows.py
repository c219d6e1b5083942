"""The example workflows: UI files reference only real node types, inputs and link types and turn into
the API files; every API file runs through the in-process runner on the tiny checkpoint and writes the
images it should (count, size, mode); the CLI exits non-zero on failure."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from PIL import Image
from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS
from qwen21_nodes.runner.cli import EXAMPLE_INPUTS, WORKFLOWS_DIR, ensure_tiny_models, run_workflow, tiny_overrides
from qwen21_nodes.runner.core_nodes import make_core_nodes
from qwen21_nodes.runner.graph import find_node, load_prompt
from qwen21_nodes.runner.ui_format import check_ui_workflow, ui_to_api

API_WORKFLOWS = sorted((WORKFLOWS_DIR / "api").glob("*.json"))
UI_WORKFLOWS = sorted(WORKFLOWS_DIR.glob("*.json"))
EXPECTED = {
    "text_to_image", "edit_1_reference", "edit_4_references", "rgba_in_out", "turbo_schedule", "fast_vae_decode",
    "turbo_lora",
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models")


def node_classes():
    return {**make_core_nodes(str(EXAMPLE_INPUTS), "", ""), **NODE_CLASS_MAPPINGS}


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
            assert len(set(thumbnail.convert("L").getdata())) > 32, f"{path.name} is (nearly) blank"


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.stem for p in UI_WORKFLOWS])
def test_ui_workflow_is_valid_and_matches_its_api_version(path):
    ui = json.loads(path.read_text())
    assert check_ui_workflow(ui, node_classes()) == []
    assert ui_to_api(ui, node_classes()) == json.loads((WORKFLOWS_DIR / "api" / path.name).read_text())
    notes = [n for n in ui["nodes"] if n["type"] == "MarkdownNote"]
    assert notes and "models/" in notes[0]["widgets_values"][0], "needs a note saying which files go where"
    sampler = next(n for n in ui["nodes"] if n["type"] == "Qwen21Sampler")
    assert sampler["widgets_values"][1] in ("fixed", "randomize", "increment", "decrement")  # after the seed


@pytest.mark.parametrize("path", API_WORKFLOWS, ids=[p.stem for p in API_WORKFLOWS])
def test_api_workflow_runs_on_the_tiny_checkpoint(path, tiny_models, tmp_path):
    prompt = load_prompt(path.read_text())
    result = run_workflow(
        path, models_dir=tiny_models, output_dir=tmp_path, overrides=tiny_overrides(prompt, tiny_models)
    )
    saver = find_node(prompt, "SaveImage")
    images = result.ui[saver]["images"]
    assert len(images) == prompt[find_node(prompt, "Qwen21Sampler")]["inputs"]["batch_size"]
    _conditioning, width, height = result.outputs[find_node(prompt, "Qwen21Encode")]
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


def test_demo_runs_on_a_tiny_checkpoint(tiny_models, tmp_path):
    done = run_cli("demo", "--tiny-dir", str(tiny_models), "--output-dir", "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with Image.open(tmp_path / "out" / "qwen21" / "text_to_image_00001_.png") as picture:
        assert picture.size == (256, 256) and picture.mode == "RGB"
