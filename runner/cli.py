"""`qwen21-nodes {run, demo, make-tiny}` (also `python -m qwen21_nodes ...`).

run:        run an API-format (or UI-format) workflow in-process with the same node classes ComfyUI
            loads, plus stand-ins for LoadImage / SaveImage / PreviewImage / Join- and SplitImageWithAlpha;
            --tiny-dir runs it on the tiny checkpoint instead of the workflow's files.
demo:       the README's first command: the text-to-image workflow on the real checkpoint when the
            models folder has it, else on a tiny random-weight checkpoint made on the spot.
make-tiny:  write the tiny random-weight checkpoint (both layouts) to a folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from ..nodes import NODE_CLASS_MAPPINGS, host, memory_adapter
from ..qwen21_core import settings
from .comfyui_only import NODES as COMFYUI_ONLY_NODES
from .core_nodes import make_core_nodes
from .graph import NodeError, RunResult, WorkflowError, apply_overrides, execute, find_node, load_prompt
from .ui_format import is_ui_workflow, ui_to_api

log = logging.getLogger("qwen21_nodes")

PACKAGE_DIR = Path(__file__).resolve().parent.parent
WORKFLOWS_DIR = PACKAGE_DIR / "workflows"
EXAMPLE_INPUTS = WORKFLOWS_DIR / "input"
MODELS_ENV = settings.MODELS
DEMO_WORKFLOW = WORKFLOWS_DIR / "api" / "text_to_image.json"
TINY_RESOLUTION, TINY_STEPS = 256, 4  # a run on the tiny checkpoint: seconds on a CPU
# (model folder, Qwen21ModelLoader input) for the three files of a ComfyUI install.
LOADER_FILES = (("diffusion_models", "diffusion_model"), ("text_encoders", "text_encoder"), ("vae", "vae"))


def node_classes(input_dir: str, output_dir: str) -> dict[str, type]:
    if not NODE_CLASS_MAPPINGS:
        raise RuntimeError("the Qwen21 node classes failed to import; the log above says why")
    host.set_output_dir(output_dir)  # where the pack's own save node writes, beside the stand-ins' SaveImage
    stand_ins = make_core_nodes(input_dir, output_dir, os.path.join(output_dir, "temp"))
    return {**COMFYUI_ONLY_NODES, **stand_ins, **NODE_CLASS_MAPPINGS}


def run_workflow(
    path: str | os.PathLike,
    *,
    models_dir: str | os.PathLike | None = None,
    input_dir: str | os.PathLike = EXAMPLE_INPUTS,
    output_dir: str | os.PathLike = "output",
    overrides: list[str] = (),
    tiny: bool = False,
) -> RunResult:
    """Load, validate and run one workflow file; raises WorkflowError / NodeError on failure. tiny: `models_dir`
    holds the tiny checkpoint; the loaders are pointed at its files and the run shrunk (tiny_overrides) before
    `overrides` apply."""
    host.set_models_dir(models_dir)
    classes = node_classes(os.fspath(input_dir), os.fspath(output_dir))
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    prompt = load_prompt(ui_to_api(data, classes) if is_ui_workflow(data) else data)
    if tiny:
        overrides = tiny_overrides(prompt, models_dir, resolution=TINY_RESOLUTION, steps=TINY_STEPS) + list(overrides)
    apply_overrides(prompt, list(overrides), classes)
    return execute(prompt, classes)


def _saved_files(result: RunResult, output_dir: str) -> list[str]:
    return [
        os.path.join(output_dir if image["type"] == "output" else os.path.join(output_dir, "temp"),
                     image["subfolder"], image["filename"])
        for ui in result.ui.values()
        for image in ui.get("images", [])
    ]  # fmt: skip


def _run_and_report(path, models_dir, input_dir, output_dir, overrides, tiny=False) -> int:
    try:
        result = run_workflow(
            path, models_dir=models_dir, input_dir=input_dir, output_dir=output_dir, overrides=overrides, tiny=tiny
        )
    except (WorkflowError, NodeError, FileNotFoundError, json.JSONDecodeError) as error:
        log.error("%s", error)
        return 1
    for node_id, ui in result.ui.items():
        for status in ui.get("qwen21_status", []):
            log.info("node %s: %s", node_id, status)
    for file in _saved_files(result, output_dir):
        log.info("wrote %s", file)
    log.info("done in %.1f s", sum(result.seconds.values()))
    return 0


def ensure_tiny_models(tiny_dir: str | os.PathLike) -> Path:
    """The tiny checkpoint in `tiny_dir`, made there first if it is not there yet."""
    from ..qwen21_core.tiny import NAMES, make_tiny

    tiny_dir = Path(tiny_dir)
    if not all((tiny_dir / name).exists() for name in NAMES.values()):  # also one made before a file was added
        log.info("making a tiny random-weight checkpoint in %s", tiny_dir)
        make_tiny(tiny_dir)
    return tiny_dir


def _demo(args) -> int:
    models_dir = args.models or settings.current().models_dir
    if models_dir:
        host.set_models_dir(models_dir)
        prompt = load_prompt(DEMO_WORKFLOW.read_text())
        loader = prompt[find_node(prompt, "Qwen21ModelLoader")]["inputs"]
        missing = [f"{k}/{loader[n]}" for k, n in LOADER_FILES if loader[n] not in host.list_weight_files(k)]
        if missing:
            log.error("the models folder %s lacks %s; see README 'Model files'", models_dir, ", ".join(missing))
            return 1
    else:
        log.info("no real checkpoint configured (--models or $%s): running on a tiny random-weight one", MODELS_ENV)
        return _run_and_report(DEMO_WORKFLOW, ensure_tiny_models(args.tiny_dir), EXAMPLE_INPUTS, args.output_dir,
                               args.set, tiny=True)  # fmt: skip
    return _run_and_report(DEMO_WORKFLOW, models_dir, EXAMPLE_INPUTS, args.output_dir, args.set)


def tiny_overrides(prompt: dict, models_dir: str | os.PathLike, resolution: int = 64, steps: int = 2) -> list[str]:
    """--set assignments that point a workflow's loaders at the tiny checkpoint in `models_dir` (whatever
    its files are called) and shrink the run to seconds on a CPU."""
    models_dir = Path(models_dir)
    turbo = any(n["inputs"].get("schedule") == "turbo" for n in prompt.values() if n["class_type"] == "Qwen21Sampler")
    settings = []
    for node_id, node in prompt.items():
        if node["class_type"] == "Qwen21ModelLoader":
            for kind, name in LOADER_FILES:
                settings.append(f"{node_id}.{name}={json.dumps(_tiny_file(models_dir, kind))}")
        elif node["class_type"] == "Qwen21DiffusersLoader":
            settings.append(f"{node_id}.folder={json.dumps(_tiny_diffusers_folder(models_dir, turbo))}")
        elif node["class_type"] == "Qwen21LoraLoader":
            settings.append(f"{node_id}.lora_name={json.dumps(_tiny_file(models_dir, 'loras'))}")
        elif node["class_type"] == "Qwen21Encode":
            settings.append(f"{node_id}.output_resolution={resolution}")
        elif node["class_type"] in ("Qwen21Sampler", "KSampler"):
            settings.append(f"{node_id}.steps={steps}")
        elif node["class_type"] == "LoraLoaderModelOnly":
            settings.append(f"{node_id}.lora_name={json.dumps(_tiny_file(models_dir, 'loras'))}")
        elif node["class_type"] == "Qwen21ControlLoader":
            settings.append(f"{node_id}.control_name={json.dumps(_tiny_file(models_dir, 'model_patches'))}")
    return settings


# a models folder's kind -> the tiny checkpoint's file of it (make-tiny's names: other files may sit beside them)
TINY_ROLES = {"diffusion_models": "transformer", "text_encoders": "text_encoder", "vae": "vae", "loras": "lora",
              "model_patches": "control"}


def _tiny_file(models_dir: Path, kind: str) -> str:
    from ..qwen21_core.tiny import NAMES

    path = models_dir / NAMES[TINY_ROLES[kind]]
    if not path.is_file():
        raise FileNotFoundError(f"the tiny checkpoint's {kind} file {path.name} is not in {path.parent}; make it with "
                                f"`qwen21-nodes make-tiny {models_dir}`")  # fmt: skip
    return path.name


def _tiny_diffusers_folder(models_dir: Path, turbo: bool) -> str:
    """The tiny diffusers folder; for a turbo workflow the turbo one (its model_index.json has sample_sigmas)."""
    from ..qwen21_core.tiny import NAMES

    path = models_dir / NAMES["diffusers_turbo" if turbo else "diffusers"]
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"the tiny diffusers folder {path.name} is not in {path.parent}; make it with "
                                f"`qwen21-nodes make-tiny {models_dir}`")  # fmt: skip
    return path.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qwen21-nodes", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run a workflow JSON (API or UI format) in-process")
    run.add_argument("workflow", help="path to the workflow .json")
    run.add_argument("--models", help=f"ComfyUI-style models folder (default: ${MODELS_ENV} or ./models)")
    run.add_argument("--input-dir", default=str(EXAMPLE_INPUTS), help="where LoadImage reads (default: examples)")
    run.add_argument("--output-dir", default="output", help="where SaveImage writes (default: ./output)")
    run.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE",
                     help="override an input; NODE is a node id, title or class; VALUE is JSON or text")  # fmt: skip
    run.add_argument("--vram-budget", type=float, metavar="GB",
                     help="plan with at most this much GPU memory (GiB), as on a smaller card: components are moved "
                          "off the GPU, and DiT blocks / text-encoder layers streamed, to stay inside it")  # fmt: skip
    run.add_argument("--tiny-dir", metavar="DIR",
                     help="run on the tiny random-weight checkpoint in DIR (made there if missing) instead of the "
                          f"workflow's files: its loaders point at the tiny files, {TINY_RESOLUTION} px, "
                          f"{TINY_STEPS} steps; --set still applies after")  # fmt: skip

    demo = commands.add_parser("demo", help="run the text-to-image example (tiny checkpoint if none configured)")
    demo.add_argument("--models", help=f"models folder with the real checkpoint (default: ${MODELS_ENV})")
    demo.add_argument(
        "--tiny-dir", default="tiny_models", help="where the tiny checkpoint is made (default: ./tiny_models)"
    )
    demo.add_argument("--output-dir", default="output", help="where the image is written (default: ./output)")
    demo.add_argument("--set", action="append", default=[], metavar="NODE.INPUT=VALUE", help="override an input")

    tiny = commands.add_parser("make-tiny", help="write a tiny random-weight checkpoint (both layouts)")
    tiny.add_argument("dir", help="target folder")
    tiny.add_argument("--workflows", metavar="OUT",
                      help="also write the example API workflows to OUT, pointed at the tiny files (for POST /prompt "
                           "to a ComfyUI whose models folder is DIR)")  # fmt: skip

    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    if args.command == "run":
        if args.vram_budget is not None:
            if args.vram_budget <= 0:
                parser.error(f"--vram-budget must be a positive number of GiB, got {args.vram_budget}")
            memory_adapter.set_vram_budget(int(args.vram_budget * 2**30))
        if args.tiny_dir:
            if args.models:
                parser.error("--tiny-dir and --models name two models folders: give one")
            tiny_dir = ensure_tiny_models(args.tiny_dir)
            return _run_and_report(args.workflow, tiny_dir, args.input_dir, args.output_dir, args.set, tiny=True)
        models = args.models or settings.current().models_dir or "models"
        return _run_and_report(args.workflow, models, args.input_dir, args.output_dir, args.set)
    if args.command == "demo":
        return _demo(args)
    from ..qwen21_core.tiny import make_tiny

    make_tiny(Path(args.dir))
    log.info("wrote a tiny checkpoint to %s", args.dir)
    if args.workflows:
        for path in write_tiny_workflows(args.dir, args.workflows):
            log.info("wrote %s", path)
    return 0


def write_tiny_workflows(models_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """The example API workflows, each pointed at the tiny checkpoint in `models_dir` and shrunk as `run
    --tiny-dir` does, written to `out_dir` under their own names."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for source in sorted((WORKFLOWS_DIR / "api").glob("*.json")):
        prompt = load_prompt(source.read_text(encoding="utf-8"))
        apply_overrides(prompt, tiny_overrides(prompt, models_dir, TINY_RESOLUTION, TINY_STEPS), {})
        target = out_dir / source.name
        target.write_text(json.dumps(prompt, indent=1) + "\n", encoding="utf-8")
        written.append(target)
    return written
