"""The pack inside a real ComfyUI server, driven over its HTTP API as a user's client would.

Needs COMFYUI_DIR (a ComfyUI checkout; 0.3.64 runs on a CPU) and an interpreter with ComfyUI's
requirements (COMFYUI_PYTHON, else $COMFYUI_DIR/venv or .venv, else this one); COMFYUI_EXTRA_ARGS is added to
every server's command line (the GPU run passes `--front-end-root`: no frontend package there). The server gets a
private base directory: the pack (a symlink under another folder name) in custom_nodes/, the tiny
checkpoint in models/ (the VAE through extra_model_paths.yaml), and the example images uploaded
through POST /upload/image.
"""

import json
import os
import random
import shlex
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

requests = pytest.importorskip("requests", reason="the ComfyUI server tests need `requests` (pip install requests)")
websocket = pytest.importorskip(
    "websocket", reason="the ComfyUI server tests need `websocket-client` (pip install websocket-client)"
)

from qwen21_nodes.runner.cli import EXAMPLE_INPUTS, WORKFLOWS_DIR, tiny_overrides  # noqa: E402
from qwen21_nodes.runner.graph import apply_overrides, find_node, load_prompt  # noqa: E402
from qwen21_nodes.runner.ui_format import check_ui_workflow  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
PACK_FOLDER = "qwen21-under-test"
API_WORKFLOWS = sorted((WORKFLOWS_DIR / "api").glob("*.json"))
UI_WORKFLOWS = sorted(WORKFLOWS_DIR.glob("*.json"))
TEXT_TO_IMAGE = WORKFLOWS_DIR / "api" / "text_to_image.json"
RUN_TIMEOUT_S = 300
WRONG_DIT_FILE = "wrong_file_a_vae.safetensors"  # a VAE in diffusion_models/: the loader must say so

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

    def queue(self, prompt: dict, client_id: str = "qwen21-tests", extra_data: dict | None = None) -> str:
        body = {"prompt": prompt, "client_id": client_id, **({"extra_data": extra_data} if extra_data else {})}
        reply = self.post("/prompt", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["prompt_id"]

    def listen(self) -> "Events":
        """The server's messages to one new client id (progress, executing, ...), as a client sees them."""
        return Events(self.url, self.log)

    def wait_for_log(self, text: str, after: int = 0, timeout: float = 30) -> None:
        """Wait until `text` appears in the server log past character `after`."""
        deadline = time.monotonic() + timeout
        while text not in self.log()[after:]:
            assert time.monotonic() < deadline, f"no {text!r} in the server log in {timeout} s:\n" + self.log()[-4000:]
            time.sleep(0.25)

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


class Events:
    """A websocket client of the server: the JSON messages sent to its client id, in order."""

    def __init__(self, url: str, log):
        self.client_id = f"qwen21-tests-{uuid.uuid4().hex[:8]}"
        self.log = log
        self.socket = websocket.create_connection(
            url.replace("http://", "ws://") + f"/ws?clientId={self.client_id}", timeout=RUN_TIMEOUT_S
        )
        self.seen: list[dict] = []
        self.binary = 0  # preview images received

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.socket.close()

    def wait_for(self, matches, what: str) -> dict:
        """Read messages until one matches (binary ones are preview images: counted in `binary`)."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline:
            frame = self.socket.recv()
            if isinstance(frame, str):
                self.seen.append(json.loads(frame))
                if matches(self.seen[-1]):
                    return self.seen[-1]
            else:
                self.binary += 1
        raise AssertionError(f"no {what} in {RUN_TIMEOUT_S} s; messages: {self.seen[-20:]}\n" + self.log()[-4000:])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from qwen21_nodes.qwen21_core.tiny import make_tiny

    models = tmp_path_factory.mktemp("tiny_models")
    make_tiny(models)
    return models


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_models):
    yield from _running_server(tmp_path_factory, tiny_models)


@pytest.fixture(scope="module", params=["--lowvram", "--novram", "--novram --disable-cuda-malloc"])
def lowvram_server(request, tmp_path_factory, tiny_models):
    """A ComfyUI on the GPU whose memory manager loads models partially: --lowvram gives each model what is free
    beyond the run's estimate (the tiny models fit whole), --novram gives it almost nothing (every layer streams).
    Both with ComfyUI's default cudaMallocAsync allocator (decode graphs capture under it where every kernel launches
    directly, but not while layers stream), and --novram also with the native one (--disable-cuda-malloc: the decode
    graphs capture while layers stream). ComfyUI refuses both
    beside --cpu and treats a CPU device as never short of memory, so this needs a GPU."""
    probe = subprocess.run([_python(), "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    if probe.stdout.strip() != "True":
        pytest.skip(f"{request.param} needs ComfyUI on a CUDA GPU (it refuses it with --cpu); none here")
    yield from _running_server(tmp_path_factory, tiny_models, *request.param.split(), cpu=False)


def _running_server(tmp_path_factory, tiny_models, *extra_args: str, cpu: bool = True):
    base = tmp_path_factory.mktemp("comfy_base")
    for folder in ("custom_nodes", "input", "output", "temp", "user", "models"):
        (base / folder).mkdir()
    (base / "custom_nodes" / PACK_FOLDER).symlink_to(REPO, target_is_directory=True)
    for kind in ("text_encoders", "diffusers", "loras", "model_patches"):
        if (tiny_models / kind).exists():
            (base / "models" / kind).symlink_to(tiny_models / kind, target_is_directory=True)
    (base / "models" / "diffusion_models").mkdir()
    for dit in (tiny_models / "diffusion_models").iterdir():
        (base / "models" / "diffusion_models" / dit.name).symlink_to(dit)
    (vae_file,) = (tiny_models / "vae").glob("*.safetensors")
    (base / "models" / "diffusion_models" / WRONG_DIT_FILE).symlink_to(vae_file)
    # The VAE only through extra_model_paths.yaml, to show that file is honoured.
    (base / "extra_model_paths.yaml").write_text(f"qwen21_tests:\n    vae: {tiny_models / 'vae'}\n")
    log_path = base / "server.log"
    port = _free_port()
    command = [
        _python(), "main.py", *(["--cpu"] if cpu else []), "--listen", "127.0.0.1", "--port", str(port),
        "--base-directory", str(base), "--extra-model-paths-config", str(base / "extra_model_paths.yaml"),
        "--database-url", "sqlite:///:memory:", "--preview-method", "auto", *extra_args,
        *shlex.split(os.environ.get("COMFYUI_EXTRA_ARGS", "")),
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


def failure_report(entry: dict, server: Server) -> str:
    """A failed run as a reader needs it: the node's exception, the end of its traceback, the server log's end."""
    for event, data in entry["status"].get("messages", []):
        if event == "execution_error":
            error = f"{data.get('node_type')}: {data.get('exception_type')}: {data.get('exception_message')}"
            trace = "".join(data.get("traceback", [])[-4:])
            return f"{error}\n{trace}\n--- server log ---\n{server.log()[-3000:]}"
    return json.dumps(entry["status"], indent=1)[-3000:]


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


KSAMPLER_WORKFLOWS = [path for path in API_WORKFLOWS if path.stem.startswith("ksampler_")]
OUR_SAMPLER_WORKFLOWS = [path for path in API_WORKFLOWS if path not in KSAMPLER_WORKFLOWS]


@pytest.mark.parametrize("path", KSAMPLER_WORKFLOWS, ids=[p.stem for p in KSAMPLER_WORKFLOWS])
def test_ksampler_workflow_runs_on_our_model_and_images_come_back(server, path):
    """KSampler (and LoraLoaderModelOnly, VAE Decode, Save Image) on the loader's MODEL and VAE: RGB images come
    back (ComfyUI's IMAGE), the prefix computed once per conditioning (the log line our sampling wrapper writes)."""
    prompt = tiny_prompt(path, server.models)
    saver = find_node(prompt, "SaveImage")
    prompt[saver]["inputs"]["filename_prefix"] = f"test_{path.stem}_{uuid.uuid4().hex[:6]}"
    mark = len(server.log())
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "success", failure_report(entry, server)
    (image,) = entry["outputs"][saver]["images"]
    with fetch_png(server, image) as picture:
        assert picture.mode == "RGB" and all(side % 32 == 0 for side in picture.size)
    steps = prompt[find_node(prompt, "KSampler")]["inputs"]["steps"]
    assert f"qwen21: {steps} model calls, 1 prefix computations" in server.log()[mark:], server.log()[mark:][-3000:]
    assert "Requested to load Qwen21ComfyModel" in server.log()


@pytest.mark.parametrize("node", ["EmptyLatentImage", "EmptySD3LatentImage"])
def test_comfyuis_empty_latent_gives_the_size_asked_for_or_a_named_error(server, node):
    """ComfyUI's own empty latents make 1/8 latents of another model's channels; on our MODEL the image has the
    size asked for (not twice the side), and a size 16-pixel steps cannot give is refused by name."""
    prompt = tiny_prompt(WORKFLOWS_DIR / "api" / "ksampler_text_to_image.json", server.models)
    sampler, saver = find_node(prompt, "KSampler"), find_node(prompt, "SaveImage")
    prompt["91"] = {"class_type": node, "inputs": {"width": 256, "height": 160, "batch_size": 1}}
    prompt[sampler]["inputs"]["latent_image"] = ["91", 0]
    prompt[saver]["inputs"]["filename_prefix"] = f"test_empty_{uuid.uuid4().hex[:6]}"
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "success", failure_report(entry, server)
    (image,) = entry["outputs"][saver]["images"]
    with fetch_png(server, image) as picture:
        assert picture.size == (256, 160)
    prompt["91"]["inputs"].update(width=200, height=136)
    failure = run_to_error(server, prompt)
    assert failure["node_type"] == "KSampler" and "200x136 px" in failure["exception_message"]
    assert "steps of 16 px" in failure["exception_message"]


def test_a_model_patch_that_cannot_apply_is_named_and_the_next_ksampler_run_works(server):
    """Perturbed-Attention Guidance (it replaces a UNet block's self-attention) on our MODEL: a node error naming
    the patch, the server stays up, and the same workflow without it runs."""
    prompt = tiny_prompt(WORKFLOWS_DIR / "api" / "ksampler_text_to_image.json", server.models)
    sampler = find_node(prompt, "KSampler")
    prompt["90"] = {"class_type": "PerturbedAttentionGuidance",
                    "inputs": {"model": prompt[sampler]["inputs"]["model"], "scale": 3.0}}  # fmt: skip
    prompt[sampler]["inputs"]["model"] = ["90", 0]
    failure = run_to_error(server, prompt)
    assert failure["node_type"] == "KSampler" and "cannot apply to our DiT" in failure["exception_message"]
    assert "attn1" in failure["exception_message"]
    good = tiny_prompt(WORKFLOWS_DIR / "api" / "ksampler_text_to_image.json", server.models, "KSampler.seed=11")
    assert server.wait(server.queue(good))["status"]["status_str"] == "success"


@pytest.mark.parametrize("path", OUR_SAMPLER_WORKFLOWS, ids=[p.stem for p in OUR_SAMPLER_WORKFLOWS])
def test_api_workflow_runs_and_images_come_back(server, path):
    prompt = tiny_prompt(path, server.models)
    prefix = f"test_{path.stem}_{uuid.uuid4().hex[:6]}"
    saver = find_node(prompt, "Qwen21SaveImage")
    prompt[saver]["inputs"]["filename_prefix"] = prefix
    workflow = {"nodes": [{"id": int(saver), "type": "Qwen21SaveImage"}], "links": [], "note": path.stem}
    entry = server.wait(server.queue(prompt, extra_data={"extra_pnginfo": {"workflow": workflow}}))
    assert entry["status"]["status_str"] == "success", failure_report(entry, server)
    images = entry["outputs"][saver]["images"]
    assert [image["filename"] for image in images] == [f"{prefix}_{n:05}_.png" for n in range(1, len(images) + 1)]
    sampler = prompt[find_node(prompt, "Qwen21Sampler")]["inputs"]
    assert len(images) == sampler["batch_size"]
    expected_mode = "RGBA" if any(n["class_type"] == "JoinImageWithAlpha" for n in prompt.values()) else "RGB"
    sizes = set()
    for image in images:
        with fetch_png(server, image) as picture:
            assert picture.mode == expected_mode
            sizes.add(picture.size)
            # Qwen21 Save Image writes what ComfyUI's Save Image would: the prompt and the UI's workflow
            # (ComfyUI adds each node's is_changed to the prompt it passes)
            saved_prompt = json.loads(picture.text["prompt"])
            assert {k: (v["class_type"], v["inputs"]) for k, v in saved_prompt.items()} == {
                k: (v["class_type"], v["inputs"]) for k, v in prompt.items()
            }
            assert json.loads(picture.text["workflow"]) == workflow
    assert len(sizes) == 1 and all(side % 32 == 0 for side in sizes.pop())
    executed = [event for event, _data in entry["status"]["messages"]]
    assert "execution_success" in executed


@pytest.mark.parametrize("workflow", ["text_to_image", "rgba_in_out"])
def test_comfyuis_save_image_and_ours_save_the_same_pixels(server, workflow):
    """The example workflows save with Qwen21 Save Image; ComfyUI's Save Image in its place (ComfyUI caches everything
    before it) must save the same image, RGB and RGBA."""
    import numpy as np

    prompt = tiny_prompt(WORKFLOWS_DIR / "api" / f"{workflow}.json", server.models)
    saver = find_node(prompt, "Qwen21SaveImage")
    pixels = {}
    for class_type in ("Qwen21SaveImage", "SaveImage"):
        prompt[saver]["class_type"] = class_type
        prompt[saver]["inputs"]["filename_prefix"] = f"test_savers_{uuid.uuid4().hex[:6]}"
        entry = server.wait(server.queue(prompt))
        assert entry["status"]["status_str"] == "success", failure_report(entry, server)
        (image,) = entry["outputs"][saver]["images"]
        with fetch_png(server, image) as picture:
            pixels[class_type] = (picture.mode, np.asarray(picture))
    (ours_mode, ours), (comfy_mode, comfy) = pixels["Qwen21SaveImage"], pixels["SaveImage"]
    assert ours_mode == comfy_mode == ("RGBA" if workflow == "rgba_in_out" else "RGB")
    assert np.array_equal(ours, comfy)


@pytest.mark.parametrize("name", ["text_to_image", "edit_4_references", "ksampler_text_to_image", "ksampler_lora"])
def test_workflows_run_under_lowvram(lowvram_server, name):
    """ComfyUI's --lowvram / --novram: our DiT and text encoder are registered for partial loads (tests/test_memory.py
    checks what they ask for); the workflows must run under them as they do without, through our sampler and through
    KSampler on our MODEL (the same patcher). Under --novram ComfyUI offers each model almost no memory, so the log
    must show both placed with streamed layers."""
    server = lowvram_server
    run_start = len(server.log())  # the start-up may hold other packs' import tracebacks; the run may not
    prompt = tiny_prompt(WORKFLOWS_DIR / "api" / f"{name}.json", server.models)
    saver = find_node(prompt, "SaveImage" if name.startswith("ksampler_") else "Qwen21SaveImage")
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "success", failure_report(entry, server)
    batch = 1 if name.startswith("ksampler_") else prompt[find_node(prompt, "Qwen21Sampler")]["inputs"]["batch_size"]
    assert len(entry["outputs"][saver]["images"]) == batch
    log = server.log()
    assert "Traceback" not in log[run_start:], log[run_start:][-3000:]
    if "--novram" in server.process.args:
        placements = [line for line in log.splitlines() if "qwen21: " in line and " on cuda" in line]
        streamed = [line for line in placements if "layers resident" in line]
        assert {"QwenImage21Transformer", "Qwen21TextEncoder"} <= {line.split("qwen21: ")[1].split()[0]
                                                                   for line in streamed}, placements  # fmt: skip


def test_lora_workflow_runs_on_fp8_weights_merged_beside_and_as_saved_before_the_mode_input(server):
    """The turbo_lora workflow with an fp8 DiT (the side path crashed on CPU before issue 23): the default merge,
    the side path, and the prompt as a workflow saved before the node had its `mode` input (absent: merge)."""
    lora = "Qwen21LoraLoader"
    for case in ("merge", "side_path", "absent"):
        run_start = len(server.log())
        extra = ["Qwen21ModelLoader.weight_dtype=fp8", f"Qwen21Sampler.seed={random.randrange(2**32)}"]
        prompt = tiny_prompt(WORKFLOWS_DIR / "api" / "turbo_lora.json", server.models, *extra)
        if case == "absent":
            del prompt[find_node(prompt, lora)]["inputs"]["mode"]
        else:
            prompt[find_node(prompt, lora)]["inputs"]["mode"] = case
        entry = server.wait(server.queue(prompt))
        assert entry["status"]["status_str"] == "success", f"{case}: " + failure_report(entry, server)
        assert len(entry["outputs"][find_node(prompt, "Qwen21SaveImage")]["images"]) == 1
        applied = [line for line in server.log()[run_start:].splitlines() if "LoRA stack" in line and "applied" in line]
        assert applied, f"{case}: no LoRA was applied:\n" + server.log()[run_start:][-3000:]
        kind = "'side_paths': 0" if case != "side_path" else "'weights_merged': 0"  # the other kind, none of it
        assert kind in applied[-1], (case, applied[-1])


def test_sampler_reports_stats_in_its_ui_output(server):
    prompt = tiny_prompt(WORKFLOWS_DIR / "api" / "text_to_image.json", server.models, "Qwen21Sampler.seed=7")
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "success"
    stats = entry["outputs"][find_node(prompt, "Qwen21Sampler")]["qwen21_stats"][0]
    assert stats["steps"] == prompt[find_node(prompt, "Qwen21Sampler")]["inputs"]["steps"]
    assert "prefix_cache" in stats
    assert "Requested to load Qwen21ComfyModel" in server.log(), "the DiT was not registered with load_models_gpu"


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
    failure = run_to_error(server, prompt)
    assert failure["node_type"] == "Qwen21Sampler" and failure["exception_type"] == "ValueError"
    assert "sigmas" in failure["exception_message"]
    assert server.get("/system_stats").status_code == 200


def run_to_error(server: Server, prompt: dict | None = None, prompt_id: str | None = None) -> dict:
    """Queue a prompt (or take one queued) that must fail while running; its execution_error message."""
    entry = server.wait(prompt_id or server.queue(prompt))
    assert entry["status"]["status_str"] == "error", [event for event, _ in entry["status"]["messages"]]
    return dict(entry["status"]["messages"])["execution_error"]


def _crafted_loras(folder: Path) -> dict[str, str]:
    """Two hostile LoRAs for the tiny DiT, written into `folder` (a sub-folder of the server's loras: the tiny
    workflows' overrides expect one LoRA at the top): file name -> what the error must say. A regex bomb in the
    PEFT metadata (alpha_pattern keys that a backtracking engine matches for ever while holding the interpreter
    lock: the whole server froze) and a rank-0 LoRA (a ZeroDivisionError before)."""
    import torch
    from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer
    from qwen21_nodes.qwen21_core.lora.merge import layer_shapes
    from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER
    from safetensors.torch import save_file

    folder.mkdir(exist_ok=True)
    shapes = layer_shapes(QwenImage21Transformer(TINY_TRANSFORMER))
    layers = sorted(name for name, shape in shapes.items() if len(shape) == 2 and name.startswith("transformer_"))[:8]
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in layers:
        out, inp = shapes[layer]
        tensors[f"transformer.{layer}.lora_A.weight"] = torch.randn(4, inp, generator=g)
        tensors[f"transformer.{layer}.lora_B.weight"] = torch.randn(out, 4, generator=g)
    patterns = {"(.|.)*Q": 4, **{f"(.*){{1,50}}[0-9]*x{i}": 4 for i in range(200)}}
    config = {"transformer.r": 4, "transformer.lora_alpha": 4, "transformer.alpha_pattern": patterns}
    metadata = {"lora_adapter_metadata": json.dumps(config)}
    save_file(tensors, folder / "crafted_regex_bomb.safetensors", metadata=metadata)
    out, inp = shapes[layers[0]]
    empty = {f"diffusion_model.{layers[0]}.lora_down.weight": torch.zeros(0, inp),
             f"diffusion_model.{layers[0]}.lora_up.weight": torch.zeros(out, 0)}  # fmt: skip
    save_file(empty, folder / "crafted_rank_0.safetensors")
    return {"crafted_regex_bomb.safetensors": "too complex", "crafted_rank_0.safetensors": "rank 0"}


def test_a_crafted_lora_is_a_node_error_and_the_server_stays_up(server):
    crafted = _crafted_loras(server.models / "loras" / "crafted")
    for name, says in crafted.items():
        seed = random.randrange(2**32)
        prompt = tiny_prompt(WORKFLOWS_DIR / "api" / "turbo_lora.json", server.models,
                             f"Qwen21LoraLoader.lora_name=crafted/{name}", f"Qwen21Sampler.seed={seed}")  # fmt: skip
        prompt_id = server.queue(prompt)
        started = time.monotonic()
        while prompt_id not in server.get(f"/history/{prompt_id}").json():  # the server answers throughout
            assert server.get("/system_stats").status_code == 200
            assert time.monotonic() - started < 120, f"{name}: no result in 120 s\n" + server.log()[-3000:]
            time.sleep(0.25)
        failure = run_to_error(server, prompt_id=prompt_id)
        assert failure["node_type"] == "Qwen21LoraLoader", failure
        assert failure["exception_type"] == "qwen21_nodes.qwen21_core.lora.reading.LoraError", failure
        assert name in failure["exception_message"] and says in failure["exception_message"], failure
    prompt = tiny_prompt(TEXT_TO_IMAGE, server.models, f"Qwen21Sampler.seed={random.randrange(2**32)}")
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "success", failure_report(entry, server)


def test_our_errors_carry_the_package_name_not_the_pack_folder_path(server):
    # ComfyUI names the pack's modules after its folder path; exception_type must not show that path.
    prompt = tiny_prompt(
        TEXT_TO_IMAGE,
        server.models,
        f"Qwen21ModelLoader.diffusion_model={WRONG_DIT_FILE}",
    )
    failure = run_to_error(server, prompt)
    assert failure["node_type"] == "Qwen21ModelLoader"
    assert failure["exception_type"] == "qwen21_nodes.qwen21_core.checkpoints.files.WrongModelError"
    assert "load it as the vae" in failure["exception_message"]
    assert server.get("/system_stats").status_code == 200


def test_a_17th_condition_image_is_an_error_not_dropped(server):
    prompt = tiny_prompt(WORKFLOWS_DIR / "api" / "edit_1_reference.json", server.models)
    encoder = find_node(prompt, "Qwen21Encode")
    prompt[encoder]["inputs"]["image_17"] = prompt[encoder]["inputs"]["image_1"]
    failure = run_to_error(server, prompt)
    assert failure["node_type"] == "Qwen21Encode" and failure["exception_type"] == "ValueError"
    assert "image_17" in failure["exception_message"] and "at most 16" in failure["exception_message"]


def test_interrupt_stops_a_run_within_a_step_and_the_next_run_works(server):
    # A seed no earlier run used, so ComfyUI cannot serve the sampler from its cache; a step at 1536x1536
    # takes ~0.4 s on the tiny model (more on a busy machine), far longer than the interrupt's round trip,
    # and 200 of them keep it sampling when the interrupt arrives, sent after the first progress message.
    seed = random.randrange(2**32)
    steps = 200
    slow = tiny_prompt(
        TEXT_TO_IMAGE,
        server.models,
        f"Qwen21Sampler.steps={steps}",
        f"Qwen21Sampler.seed={seed}",
        "Qwen21Encode.output_resolution=1536",
    )
    sampler = find_node(slow, "Qwen21Sampler")

    def sampler_progress(message):
        data = message.get("data", {})
        return message["type"] == "progress" and data.get("prompt_id") == prompt_id and data.get("node") == sampler

    with server.listen() as events:
        prompt_id = server.queue(slow, client_id=events.client_id)
        first = events.wait_for(sampler_progress, "progress message from the sampler")
        assert server.post("/interrupt", json={"prompt_id": prompt_id}).status_code == 200
        asked = time.monotonic()
        sent_before = len(events.seen)
        events.wait_for(
            lambda m: (
                m["type"] in ("execution_interrupted", "execution_success", "execution_error")
                and m["data"].get("prompt_id") == prompt_id
            ),
            "end of the interrupted prompt",
        )
        stopped_after = time.monotonic() - asked
    entry = server.wait(prompt_id)
    messages = dict(entry["status"]["messages"])
    assert entry["status"]["status_str"] == "error" and "execution_interrupted" in messages, list(messages)
    assert "execution_success" not in messages and "execution_error" not in messages
    assert messages["execution_interrupted"]["node_id"] == sampler
    assert messages["execution_interrupted"]["node_type"] == "Qwen21Sampler"
    assert entry["outputs"] == {}, "an interrupted run saved outputs"
    # At most the step in flight when the interrupt arrived reports progress after it.
    later = [m["data"]["value"] for m in events.seen[sent_before:] if sampler_progress(m)]
    last_step = max([first["data"]["value"], *later])
    assert len(later) <= 1 and last_step < steps, (first["data"], later)
    assert stopped_after < 10, f"took {stopped_after:.1f} s to stop after the interrupt"

    prompt = tiny_prompt(TEXT_TO_IMAGE, server.models, f"Qwen21Sampler.seed={seed}")
    entry = server.wait(server.queue(prompt))
    assert entry["status"]["status_str"] == "success"
    assert sampler in executed_nodes(entry), "the next run's sampler did not run"


def test_ksampler_on_our_model_shows_progress_and_previews_and_stops_on_interrupt(server):
    """As with a native model: KSampler's progress messages and preview images (binary frames, --preview-method auto:
    our latent format's RGB projection, fitted from our VAE) arrive per step, an interrupt stops the run within a
    step, and the next run works (the run's branches were released when ComfyUI's sampling ended)."""
    seed = random.randrange(2**32)
    slow = tiny_prompt(WORKFLOWS_DIR / "api" / "ksampler_text_to_image.json", server.models, "KSampler.steps=200",
                       f"KSampler.seed={seed}", "Qwen21Encode.output_resolution=1536")  # fmt: skip
    sampler = find_node(slow, "KSampler")

    def sampler_progress(message):
        data = message.get("data", {})
        return message["type"] == "progress" and data.get("prompt_id") == prompt_id and data.get("node") == sampler

    with server.listen() as events:
        prompt_id = server.queue(slow, client_id=events.client_id)
        events.wait_for(sampler_progress, "progress message from KSampler")
        previews_before = events.binary
        events.wait_for(lambda m: sampler_progress(m) and m["data"]["value"] >= 3, "a third step's progress")
        assert events.binary > previews_before, "no preview image came with KSampler's steps"
        assert server.post("/interrupt", json={"prompt_id": prompt_id}).status_code == 200
        events.wait_for(lambda m: m["type"] in ("execution_interrupted", "execution_success", "execution_error")
                        and m["data"].get("prompt_id") == prompt_id, "end of the interrupted prompt")  # fmt: skip
    messages = dict(server.wait(prompt_id)["status"]["messages"])
    assert "execution_interrupted" in messages and messages["execution_interrupted"]["node_type"] == "KSampler"
    again = tiny_prompt(WORKFLOWS_DIR / "api" / "ksampler_text_to_image.json", server.models, f"KSampler.seed={seed}")
    assert server.wait(server.queue(again))["status"]["status_str"] == "success"


def executed_nodes(entry: dict) -> set[str]:
    """The node ids a finished prompt ran (every node of the prompt less the ones served from cache)."""
    cached = {n for event, data in entry["status"]["messages"] if event == "execution_cached" for n in data["nodes"]}
    return set(entry["prompt"][2]) - cached


def test_free_releases_models_and_the_next_run_loads_again(server):
    prompt = tiny_prompt(TEXT_TO_IMAGE, server.models, "Qwen21Sampler.seed=11")
    loader, sampler = find_node(prompt, "Qwen21ModelLoader"), find_node(prompt, "Qwen21Sampler")
    assert server.wait(server.queue(prompt))["status"]["status_str"] == "success"
    # A run on the loaded model keeps its decode graphs (ComfyUI detaches a model it loads again, weights
    # in place: that is no unload).
    mark = len(server.log())
    entry = server.wait(server.queue(tiny_prompt(TEXT_TO_IMAGE, server.models, "Qwen21Sampler.seed=10")))
    assert entry["status"]["status_str"] == "success" and sampler in executed_nodes(entry)
    assert "Qwen21 released" not in server.log()[mark:], "an ordinary run released the decode graphs"

    # "Unload models": ComfyUI unloads the weights; our hook frees the decode graphs and their prefix
    # caches with them. The loader's output stays cached, and the next run loads the weights again.
    mark = len(server.log())
    assert server.post("/free", json={"unload_models": True}).status_code == 200
    server.wait_for_log("Qwen21 released", after=mark)
    assert "Qwen21 model freed" not in server.log()[mark:], "unloading the weights dropped the whole model"
    mark = len(server.log())
    entry = server.wait(server.queue(tiny_prompt(TEXT_TO_IMAGE, server.models, "Qwen21Sampler.seed=12")))
    assert entry["status"]["status_str"] == "success"
    assert loader not in executed_nodes(entry) and sampler in executed_nodes(entry)
    assert "Requested to load Qwen21ComfyModel" in server.log()[mark:], "the unloaded DiT was not loaded again"

    # "Free model and node cache": the model handle goes, and with it everything built on the weights.
    mark = len(server.log())
    assert server.post("/free", json={"unload_models": True, "free_memory": True}).status_code == 200
    server.wait_for_log("Qwen21 model freed", after=mark)
    entry = server.wait(server.queue(tiny_prompt(TEXT_TO_IMAGE, server.models, "Qwen21Sampler.seed=13")))
    assert entry["status"]["status_str"] == "success"
    assert loader in executed_nodes(entry), "the loader stayed cached"


def test_templates_are_listed_with_their_thumbnails(server):
    # ComfyUI lists custom_nodes/<pack>/workflows/*.json as templates; the browser shows <name>.jpg beside each.
    listed = server.get("/workflow_templates").json()
    assert sorted(listed.get(PACK_FOLDER, [])) == sorted(p.stem for p in UI_WORKFLOWS), listed
    for name in listed[PACK_FOLDER]:
        reply = server.get(f"/api/workflow_templates/{PACK_FOLDER}/{name}.jpg")
        assert reply.status_code == 200, f"no thumbnail for the template {name}"
        assert reply.headers["Content-Type"] == "image/jpeg" and reply.content[:3] == b"\xff\xd8\xff", name
