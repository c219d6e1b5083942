"""The pack inside a real ComfyUI server, driven over its HTTP API as a user's client would.

Needs COMFYUI_DIR (a ComfyUI checkout; 0.3.64 runs on a CPU) and an interpreter with ComfyUI's
requirements (COMFYUI_PYTHON, else $COMFYUI_DIR/venv or .venv, else this one). The server gets a
private base directory: the pack (a symlink under another folder name) in custom_nodes/, the tiny
checkpoint in models/ (the VAE through extra_model_paths.yaml), and the example images uploaded
through POST /upload/image.
"""

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

requests = pytest.importorskip("requests", reason="the ComfyUI server tests need `requests` (pip install requests)")

from qwen21_nodes.runner.cli import EXAMPLE_INPUTS, WORKFLOWS_DIR, tiny_overrides  # noqa: E402
from qwen21_nodes.runner.graph import apply_overrides, find_node, load_prompt  # noqa: E402
from qwen21_nodes.runner.ui_format import check_ui_workflow  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
PACK_FOLDER = "qwen21-under-test"
API_WORKFLOWS = sorted((WORKFLOWS_DIR / "api").glob("*.json"))
UI_WORKFLOWS = sorted(WORKFLOWS_DIR.glob("*.json"))
RUN_TIMEOUT_S = 300

pytestmark = [
    pytest.mark.comfyui,
    pytest.mark.skipif(
        not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "main.py").is_file(),
        reason="set COMFYUI_DIR to a ComfyUI checkout (with main.py) to run the server tests",
    ),
]


def _python() -> str:
    if os.environ.get("COMFYUI_PYTHON"):
        return os.environ["COMFYUI_PYTHON"]
    for venv in ("venv", ".venv"):
        candidate = Path(COMFYUI_DIR) / venv / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    return sys.executable


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, url: str, process: subprocess.Popen, log_path: Path, models: Path):
        self.url, self.process, self.log_path, self.models = url, process, log_path, models

    def get(self, path: str, **kwargs):
        return requests.get(self.url + path, timeout=30, **kwargs)

    def post(self, path: str, **kwargs):
        return requests.post(self.url + path, timeout=30, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def queue(self, prompt: dict) -> str:
        reply = self.post("/prompt", json={"prompt": prompt, "client_id": "qwen21-tests"})
        assert reply.status_code == 200, reply.text
        return reply.json()["prompt_id"]

    def wait(self, prompt_id: str) -> dict:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, "the ComfyUI server died:\n" + self.log()[-4000:]
            history = self.get(f"/history/{prompt_id}").json()
            if prompt_id in history and history[prompt_id]["status"].get("completed") is not None:
                entry = history[prompt_id]
                if entry["status"]["status_str"] in ("success", "error"):
                    return entry
            time.sleep(0.25)
        raise AssertionError(f"prompt {prompt_id} did not finish in {RUN_TIMEOUT_S} s:\n" + self.log()[-4000:])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from qwen21_nodes.qwen21_core.tiny import make_tiny

    models = tmp_path_factory.mktemp("tiny_models")
    make_tiny(models)
    return models


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_models):
    base = tmp_path_factory.mktemp("comfy_base")
    for folder in ("custom_nodes", "input", "output", "temp", "user", "models"):
        (base / folder).mkdir()
    (base / "custom_nodes" / PACK_FOLDER).symlink_to(REPO, target_is_directory=True)
    for kind in ("diffusion_models", "text_encoders", "diffusers", "loras"):
        if (tiny_models / kind).exists():
            (base / "models" / kind).symlink_to(tiny_models / kind, target_is_directory=True)
    # The VAE only through extra_model_paths.yaml, to show that file is honoured.
    (base / "extra_model_paths.yaml").write_text(f"qwen21_tests:\n    vae: {tiny_models / 'vae'}\n")
    log_path = base / "server.log"
    port = _free_port()
    command = [
        _python(), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
        "--base-directory", str(base), "--extra-model-paths-config", str(base / "extra_model_paths.yaml"),
        "--database-url", "sqlite:///:memory:", "--preview-method", "auto",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, cwd=COMFYUI_DIR, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", process, log_path, tiny_models)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, "ComfyUI failed to start:\n" + server.log()[-4000:]
            try:
                if server.get("/system_stats").status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, "ComfyUI did not answer in 180 s:\n" + server.log()[-4000:]
            time.sleep(0.5)
        for image in sorted(EXAMPLE_INPUTS.glob("*.png")):
            with open(image, "rb") as f:
                reply = server.post("/upload/image", files={"image": (image.name, f, "image/png")})
            assert reply.status_code == 200, reply.text
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def tiny_prompt(path: Path, models: Path, *extra: str) -> dict:
    prompt = load_prompt(path.read_text())
    return apply_overrides(prompt, tiny_overrides(prompt, models) + list(extra), {})


def fetch_png(server: Server, image: dict):
    from io import BytesIO

    from PIL import Image

    reply = server.get("/view", params=image)
    assert reply.status_code == 200 and reply.content[:8] == b"\x89PNG\r\n\x1a\n"
    return Image.open(BytesIO(reply.content))


# --------------------------------------------------------------------------------------------------


def test_object_info_lists_every_node_with_its_inputs(server):
    from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS

    info = server.get("/object_info").json()
    assert not [line for line in server.log().splitlines() if "IMPORT FAILED" in line and PACK_FOLDER in line]
    for name, node_class in NODE_CLASS_MAPPINGS.items():
        assert name in info, f"{name} missing from /object_info"
        entry = info[name]
        declared = node_class.INPUT_TYPES()
        for section in ("required", "optional"):
            assert list(entry["input"].get(section, {})) == list(declared.get(section, {})), (name, section)
        assert entry["output"] == list(node_class.RETURN_TYPES)
        assert entry["python_module"] == f"custom_nodes.{PACK_FOLDER}"
        assert entry["category"].startswith("Qwen21")
    loader_files = info["Qwen21ModelLoader"]["input"]["required"]
    assert loader_files["vae"][0], "the VAE from extra_model_paths.yaml is not listed"


def test_ui_workflows_match_the_servers_node_definitions(server):
    info = server.get("/object_info").json()

    def as_class(entry):
        return type(
            entry["name"],
            (),
            {
                "INPUT_TYPES": classmethod(lambda cls: entry["input"]),
                "RETURN_TYPES": tuple(entry["output"]),
                "OUTPUT_NODE": entry["output_node"],
            },
        )

    classes = {name: as_class(entry) for name, entry in info.items()}
    for path in UI_WORKFLOWS:
        assert check_ui_workflow(json.loads(path.read_text()), classes) == [], path.name


@pytest.mark.parametrize("path", API_WORKFLOWS, ids=[p.stem for p in API_WORKFLOWS])
def test_api_workflow_runs_and_images_come_back(server, path):
    prompt = tiny_prompt(path, server.models)
    prefix = f"test_{path.stem}_{uuid.uuid4().hex[:6]}"
    saver = find_node(prompt, "SaveImage")
    prompt[saver]["inputs"]["filename_prefix"] = prefix
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)[-3000:]
    images = entry["outputs"][saver]["images"]
    sampler = prompt[find_node(prompt, "Qwen21Sampler")]["inputs"]
    assert len(images) == sampler["batch_size"]
    expected_mode = "RGBA" if any(n["class_type"] == "JoinImageWithAlpha" for n in prompt.values()) else "RGB"
    sizes = set()
    for image in images:
        with fetch_png(server, image) as picture:
            assert picture.mode == expected_mode
            sizes.add(picture.size)
    assert len(sizes) == 1 and all(side % 32 == 0 for side in sizes.pop())
    executed = [event for event, _data in entry["status"]["messages"]]
    assert "execution_success" in executed


def test_sampler_reports_stats_in_its_ui_output(server):
    prompt = tiny_prompt(WORKFLOWS_DIR / "api" / "text_to_image.json", server.models, "Qwen21Sampler.seed=7")
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "success"
    stats = entry["outputs"][find_node(prompt, "Qwen21Sampler")]["qwen21_stats"][0]
    assert stats["steps"] == prompt[find_node(prompt, "Qwen21Sampler")]["inputs"]["steps"]
    assert "prefix_cache" in stats
    assert "Requested to load Qwen21Weights" in server.log(), "weights were not registered with load_models_gpu"


def test_bad_input_is_a_node_error_not_a_crash(server):
    prompt = tiny_prompt(WORKFLOWS_DIR / "api" / "text_to_image.json", server.models, "Qwen21Sampler.steps=0")
    reply = server.post("/prompt", json={"prompt": prompt})
    assert reply.status_code == 400
    errors = reply.json()["node_errors"][find_node(prompt, "Qwen21Sampler")]["errors"]
    assert errors[0]["extra_info"]["input_name"] == "steps"

    prompt = tiny_prompt(
        WORKFLOWS_DIR / "api" / "text_to_image.json",
        server.models,
        "Qwen21Sampler.schedule=custom",
        "Qwen21Sampler.sigmas=not numbers",
    )
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "error"
    failure = dict(entry["status"]["messages"])["execution_error"]
    assert failure["node_type"] == "Qwen21Sampler" and failure["exception_type"].endswith("ValueError")
    assert "sigmas" in failure["exception_message"]
    assert server.get("/system_stats").status_code == 200


def test_interrupt_stops_a_run_within_a_step_and_the_next_run_works(server):
    # Same loader and prompt as the runs before (cached), so the time goes into 200 sampling steps.
    slow = tiny_prompt(
        WORKFLOWS_DIR / "api" / "text_to_image.json",
        server.models,
        "Qwen21Sampler.steps=200",
        "Qwen21Encode.output_resolution=512",
    )
    prompt_id = server.queue(slow)
    deadline = time.monotonic() + 60
    while not any(item[1] == prompt_id for item in server.get("/queue").json()["queue_running"]):
        assert time.monotonic() < deadline, "the prompt never started"
        time.sleep(0.1)
    time.sleep(3.0)
    asked = time.monotonic()
    assert server.post("/interrupt").status_code == 200
    entry = server.wait(prompt_id)
    stopped_after = time.monotonic() - asked
    messages = dict(entry["status"]["messages"])
    assert "execution_interrupted" in messages, list(messages)
    assert messages["execution_interrupted"]["node_type"] == "Qwen21Sampler"
    assert stopped_after < 10, f"took {stopped_after:.1f} s to stop"

    entry = server.wait(server.queue(tiny_prompt(WORKFLOWS_DIR / "api" / "text_to_image.json", server.models)))
    assert entry["status"]["status_str"] == "success"


def test_free_releases_models_and_the_next_run_loads_again(server):
    assert server.post("/free", json={"unload_models": True, "free_memory": True}).status_code == 200
    time.sleep(1.0)
    prompt = tiny_prompt(WORKFLOWS_DIR / "api" / "text_to_image.json", server.models, "Qwen21Sampler.seed=11")
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "success"
    cached = [data for event, data in entry["status"]["messages"] if event == "execution_cached"]
    assert cached and find_node(prompt, "Qwen21ModelLoader") not in cached[0]["nodes"], "loader stayed cached"
