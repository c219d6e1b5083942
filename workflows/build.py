"""Maintainer tool: writes the example workflows (UI format in workflows/, API format in
workflows/api/) and their input images (workflows/input/) from the descriptions below.

    python workflows/build.py            # rewrite the files
    python workflows/build.py --check    # exit 1 if a committed file differs (tests do this too)

Each workflow is written once, in API format; the UI format (drag-and-drop) is derived from it with
the node classes' INPUT_TYPES, so widget order, sockets and link types always match the nodes.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
log = logging.getLogger("workflows.build")

DIFFUSION_MODEL = "qwen_image_2.1_bf16.safetensors"
TEXT_ENCODER = "qwen3vl_8b_bf16.safetensors"
VAE = "qwen_image_2.1_vae_bf16.safetensors"
TURBO_FOLDER = "Qwen-Image-2.1-Turbo"

MODEL_NOTE = f"""## Model files

Qwen-Image-2.1 as ComfyUI ships it (https://huggingface.co/Comfy-Org/Qwen-Image-2.1):

| file | folder |
| --- | --- |
| `{DIFFUSION_MODEL}` | `ComfyUI/models/diffusion_models/` |
| `{TEXT_ENCODER}` | `ComfyUI/models/text_encoders/` |
| `{VAE}` | `ComfyUI/models/vae/` |

Or a diffusers folder (with `model_index.json`) in `ComfyUI/models/diffusers/` and the
*Qwen21 Load Diffusers Folder* node. Folders from `extra_model_paths.yaml` work too.

Input images: copy `custom_nodes/<this pack>/workflows/input/*.png` into `ComfyUI/input/`
(or pick your own in the Load Image nodes)."""

TURBO_NOTE = f"""## Model files

A Qwen-Image-2.1 **turbo** checkpoint in diffusers layout: the folder
`ComfyUI/models/diffusers/{TURBO_FOLDER}/`, whose `model_index.json` lists its few-step
`sample_sigmas`. The sampler's `turbo` schedule uses those sigmas (and ignores `steps`); a
checkpoint without them is rejected with a clear error."""

T2I_PROMPT = (
    "A cozy reading corner by a rain-streaked window at dusk, warm lamp light, a ginger cat asleep on a "
    "knitted blanket, shelves of old books, soft film grain"
)


def _loader(**inputs) -> dict:
    values = {"diffusion_model": DIFFUSION_MODEL, "text_encoder": TEXT_ENCODER, "vae": VAE}
    values.update(weight_dtype="auto", device="auto", offload_text_encoder=True)
    values.update(inputs)
    return {"class_type": "Qwen21ModelLoader", "inputs": values, "_meta": {"title": "Load Qwen-Image-2.1"}}


def _encode(prompt: str, **images) -> dict:
    inputs = {"model": ["1", 0], "prompt": prompt, "negative_prompt": "", "output_resolution": 1024, **images}
    return {"class_type": "Qwen21Encode", "inputs": inputs}


def _sampler(**inputs) -> dict:
    values = {
        "model": ["1", 0], "conditioning": ["2", 0], "seed": 42, "steps": 40, "true_cfg_scale": 1.0,
        "width": 0, "height": 0, "batch_size": 1, "schedule": "default", "sigmas": "", "denoise": 1.0,
        "prefix_cache": True, "decode_graphs": True, "compile_blocks": False,
    }  # fmt: skip
    values.update(inputs)
    return {"class_type": "Qwen21Sampler", "inputs": values}


def _decode(**inputs) -> dict:
    values = {"model": ["1", 0], "latent": ["3", 0], "tiling": "auto", "tile_size": 0, "precision": "auto"}
    values["quality"] = "exact"
    values.update(inputs)
    return {"class_type": "Qwen21VAEDecode", "inputs": values}


def _save(prefix: str, images=("4", 0)) -> dict:
    return {"class_type": "SaveImage", "inputs": {"images": list(images), "filename_prefix": f"qwen21/{prefix}"}}


def _load_image(name: str) -> dict:
    return {"class_type": "LoadImage", "inputs": {"image": name}}


def workflows() -> dict[str, tuple[dict, str]]:
    """name -> (API-format prompt, Markdown note)."""
    edit_4 = {f"image_{i}": [str(10 + i), 0] for i in range(1, 5)}
    return {
        "text_to_image": (
            {"1": _loader(), "2": _encode(T2I_PROMPT), "3": _sampler(), "4": _decode(), "5": _save("text_to_image")},
            MODEL_NOTE,
        ),
        "edit_1_reference": (
            {
                "1": _loader(),
                "11": _load_image("reference_1.png"),
                "2": _encode("Make it a watercolor painting; keep the composition", image_1=["11", 0]),
                "3": _sampler(),
                "4": _decode(),
                "5": _save("edit_1_reference"),
            },
            MODEL_NOTE,
        ),
        "edit_4_references": (
            {
                "1": _loader(),
                **{str(10 + i): _load_image(f"reference_{i}.png") for i in range(1, 5)},
                "2": _encode(
                    "Picture 1 is the room; place the lamp from picture 2, the chair from picture 3 and the "
                    "plant from picture 4 in it, in the room's lighting",
                    **edit_4,
                ),
                "3": _sampler(),
                "4": _decode(),
                "5": _save("edit_4_references"),
            },
            MODEL_NOTE,
        ),
        "rgba_in_out": (
            {
                "1": _loader(),
                "11": _load_image("rgba_subject.png"),
                "2": _encode(
                    "The same object as a glossy ceramic figurine, transparent background",
                    image_1=["11", 0],
                    mask_1=["11", 1],
                ),
                "3": _sampler(),
                "4": _decode(),
                "6": {"class_type": "JoinImageWithAlpha", "inputs": {"image": ["4", 0], "alpha": ["4", 1]}},
                "5": _save("rgba_in_out", images=("6", 0)),
            },
            MODEL_NOTE + "\n\nThe output keeps its alpha: *Join Image with Alpha* makes an RGBA PNG.",
        ),
        "turbo_schedule": (
            {
                "1": {
                    "class_type": "Qwen21DiffusersLoader",
                    "inputs": {
                        "folder": TURBO_FOLDER,
                        "weight_dtype": "auto",
                        "device": "auto",
                        "offload_text_encoder": True,
                    },
                    "_meta": {"title": "Load Qwen-Image-2.1 turbo"},
                },  # fmt: skip
                "2": _encode(T2I_PROMPT),
                "3": _sampler(schedule="turbo", steps=8),
                "4": _decode(),
                "5": _save("turbo_schedule"),
            },
            TURBO_NOTE,
        ),
        "fast_vae_decode": (
            {
                "1": _loader(),
                "2": _encode(T2I_PROMPT),
                "3": _sampler(batch_size=2),
                "4": _decode(quality="fast"),
                "5": _save("fast_vae_decode"),
            },
            MODEL_NOTE + "\n\n`quality: fast` decodes with fused kernels, faster and not bit-identical to `exact`: "
            "at 1024x1024 42.5 ms instead of 68.7 ms, 50.9 dB PSNR against exact, on an H200 (BENCHMARKS: VAE).",
        ),
    }


# --------------------------------------------------------------------------------------------------
# API -> UI format


def _order(prompt: dict) -> list[str]:
    """Node ids in dependency order (the frontend's `order`)."""
    done: list[str] = []

    def visit(node_id):
        if node_id in done:
            return
        for value in prompt[node_id]["inputs"].values():
            if isinstance(value, list):
                visit(value[0])
        done.append(node_id)

    for node_id in prompt:
        visit(node_id)
    return done


def _node_height(sockets: list, widgets: list, node_class) -> int:
    """Roughly what the frontend draws: a title, one row per socket or output, one per widget,
    and extra room for multiline text boxes and image previews."""
    from qwen21_nodes.runner.graph import input_specs

    options = [spec[2] for spec in input_specs(node_class).values()]
    rows = max(len(sockets), len(node_class.RETURN_TYPES)) + len(widgets)
    return (
        40 + 24 * rows + 90 * sum("multiline" in o for o in options) + 240 * sum("image_upload" in o for o in options)
    )


def to_ui(prompt: dict, note: str, node_classes: dict, name: str) -> dict:
    from qwen21_nodes.runner.graph import WIDGET_TYPES, input_specs
    from qwen21_nodes.runner.ui_format import widget_names

    order = _order(prompt)
    depth: dict[str, int] = {}
    for node_id in order:
        parents = [v[0] for v in prompt[node_id]["inputs"].values() if isinstance(v, list)]
        depth[node_id] = 1 + max((depth[p] for p in parents), default=-1)
    column_bottom: dict[int, int] = {}  # next free y per column
    nodes, links = [], []
    for index, node_id in enumerate(order):
        node = prompt[node_id]
        node_class = node_classes[node["class_type"]]
        column = depth[node_id]
        sockets = []
        for name, (_section, input_type, _options) in input_specs(node_class).items():
            if isinstance(input_type, list) or input_type in WIDGET_TYPES:
                continue
            value = node["inputs"].get(name)
            link_id = None
            if isinstance(value, list):
                link_id = len(links) + 1
                links.append([link_id, int(value[0]), value[1], int(node_id), len(sockets), input_type])
            sockets.append({"name": name, "type": input_type, "link": link_id})
        specs = input_specs(node_class)
        widgets = []
        for name in widget_names(node_class):
            if name == "control_after_generate":
                widgets.append("fixed")
            elif name == "upload":
                widgets.append("image")
            else:
                widgets.append(node["inputs"].get(name, specs[name][2].get("default")))
        entry = {
            "id": int(node_id),
            "type": node["class_type"],
            "pos": [40 + 420 * column, column_bottom.get(column, 40)],
            "size": [380, _node_height(sockets, widgets, node_class)],
            "flags": {},
            "order": index + 1,
            "mode": 0,
            "inputs": sockets,
            "outputs": [],
            "properties": {"Node name for S&R": node["class_type"]},
            "widgets_values": widgets,
        }
        if "_meta" in node:
            entry["title"] = node["_meta"]["title"]
        column_bottom[column] = entry["pos"][1] + entry["size"][1] + 60
        nodes.append(entry)
    by_id = {node["id"]: node for node in nodes}
    for node in nodes:
        node_class = node_classes[node["type"]]
        names = getattr(node_class, "RETURN_NAMES", node_class.RETURN_TYPES)
        node["outputs"] = [
            {"name": name, "type": kind, "slot_index": slot, "links": []}
            for slot, (name, kind) in enumerate(zip(names, node_class.RETURN_TYPES, strict=True))
        ]
    for link_id, source, slot, _target, _target_slot, _kind in links:
        by_id[source]["outputs"][slot]["links"].append(link_id)
    note_id = max(by_id) + 1
    nodes.insert(0, {
        "id": note_id, "type": "MarkdownNote", "pos": [40, -300], "size": [560, 300], "flags": {}, "order": 0,
        "mode": 0, "inputs": [], "outputs": [], "title": "Model files", "properties": {},
        "widgets_values": [note], "color": "#432", "bgcolor": "#653",
    })  # fmt: skip
    return {
        # the frontend validates this as a UUID; derived from the name so rebuilds are stable
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"qwen21-nodes/workflows/{name}")),
        "revision": 0,
        "last_node_id": note_id,
        "last_link_id": len(links),
        "nodes": nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 0.8, "offset": [0, 0]}},
        "version": 0.4,
    }


# --------------------------------------------------------------------------------------------------
# Input images: small, simple, deterministic pictures the example edits start from.


def input_images() -> dict[str, Image.Image]:
    def canvas(size, top, bottom):
        picture = Image.new("RGB", size)
        draw = ImageDraw.Draw(picture)
        for y in range(size[1]):
            t = y / max(size[1] - 1, 1)
            draw.line(
                [(0, y), (size[0], y)], fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom, strict=True))
            )
        return picture, draw

    room, draw = canvas((256, 192), (236, 224, 204), (150, 120, 96))
    draw.rectangle([0, 140, 256, 192], fill=(120, 84, 60))
    draw.rectangle([170, 30, 230, 110], fill=(170, 200, 230), outline=(90, 70, 50), width=4)
    lamp, draw = canvas((192, 192), (250, 250, 250), (220, 220, 220))
    draw.polygon([(70, 40), (122, 40), (140, 90), (52, 90)], fill=(240, 200, 90))
    draw.rectangle([92, 90, 100, 160], fill=(60, 60, 60))
    draw.rectangle([70, 160, 122, 168], fill=(60, 60, 60))
    chair, draw = canvas((160, 224), (245, 245, 245), (215, 215, 215))
    draw.rectangle([40, 110, 120, 130], fill=(150, 40, 40))
    draw.rectangle([40, 40, 56, 200], fill=(120, 30, 30))
    draw.rectangle([104, 110, 120, 200], fill=(120, 30, 30))
    plant, draw = canvas((192, 192), (250, 250, 250), (225, 225, 225))
    draw.ellipse([50, 30, 142, 120], fill=(60, 140, 70))
    draw.polygon([(70, 120), (122, 120), (112, 170), (80, 170)], fill=(190, 110, 70))
    subject = Image.new("RGBA", (192, 192), (0, 0, 0, 0))
    draw = ImageDraw.Draw(subject)
    draw.ellipse([36, 36, 156, 156], fill=(210, 70, 60, 255))
    draw.ellipse([66, 60, 96, 90], fill=(250, 220, 210, 255))
    return {
        "reference_1.png": room,
        "reference_2.png": lamp,
        "reference_3.png": chair,
        "reference_4.png": plant,
        "rgba_subject.png": subject,
    }


# --------------------------------------------------------------------------------------------------


def render_workflows() -> dict[Path, dict]:
    """Every workflow file, path -> JSON content."""
    from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS
    from qwen21_nodes.runner.core_nodes import make_core_nodes

    classes = {**make_core_nodes(str(HERE / "input"), "", ""), **NODE_CLASS_MAPPINGS}
    files = {}
    for name, (prompt, note) in workflows().items():
        files[HERE / "api" / f"{name}.json"] = prompt
        files[HERE / f"{name}.json"] = to_ui(prompt, note, classes, name)
    return files


def _same_pixels(path: Path, picture: Image.Image) -> bool:
    if not path.is_file():
        return False
    with Image.open(path) as existing:
        return existing.mode == picture.mode and existing.tobytes() == picture.tobytes()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report files that differ")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stale = []
    for path, content in render_workflows().items():
        if not (path.is_file() and json.loads(path.read_text()) == content):
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(content, indent=2) + "\n")
    for name, picture in input_images().items():
        path = HERE / "input" / name
        if not _same_pixels(path, picture):
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                picture.save(path, optimize=True)
    for path in stale:
        log.info("%s %s", "stale:" if args.check else "wrote:", path.relative_to(HERE))
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
