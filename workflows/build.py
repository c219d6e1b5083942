"""Maintainer tool: writes the example workflows (UI format in workflows/, API format in
workflows/api/), their input images (workflows/input/) and their template-browser thumbnails
(workflows/<name>.jpg) from the descriptions below.

    python workflows/build.py            # rewrite the files
    python workflows/build.py --check    # exit 1 if a committed file differs (tests do this too)

Each workflow is written once, in API format; the UI format (drag-and-drop) is derived from it with
the node classes' INPUT_TYPES, so widget order, sockets and link types always match the nodes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import uuid
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

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

TURBO_LORA = "qwen_image_2.1_turbo_lora.safetensors"

TURBO_LORA_NOTE = f"""{MODEL_NOTE}

Plus a Qwen-Image-2.1 **turbo** (few-step distillation) LoRA in `ComfyUI/models/loras/`; this workflow
names it `{TURBO_LORA}`: pick yours in *Qwen21 Load LoRA*. The sampler runs 8 steps of the
default schedule, the grid diffusers' turbo pipeline uses when a checkpoint ships no `sample_sigmas`
(set the step count your LoRA was distilled for). The LoRA is merged into the weights before
sampling (fp8 / int8 weights are requantised in their format), so the prefix cache and CUDA-graph
decode stay on and steps cost what they cost without it. Its `mode` side_path keeps quantised
weights untouched and runs the LoRA beside them instead: exact, slower steps."""

T2I_PROMPT = (
    "A cozy reading corner by a rain-streaked window at dusk, warm lamp light, a ginger cat asleep on a "
    "knitted blanket, shelves of old books, soft film grain"
)


def _loader(**inputs) -> dict:
    values = {"diffusion_model": DIFFUSION_MODEL, "text_encoder": TEXT_ENCODER, "vae": VAE}
    values.update(weight_dtype="auto", text_encoder_dtype="same", device="auto", offload_text_encoder="auto")
    values.update(text_encoder_device="auto", vae_device="auto", gpus=1)
    values.update(inputs)
    return {"class_type": "Qwen21ModelLoader", "inputs": values, "_meta": {"title": "Load Qwen-Image-2.1"}}


def _encode(prompt: str, **images) -> dict:
    inputs = {"model": ["1", 0], "prompt": prompt, "negative_prompt": "", "output_resolution": 1024, **images}
    return {"class_type": "Qwen21Encode", "inputs": inputs}


def _sampler(**inputs) -> dict:
    values = {
        "model": ["1", 0], "conditioning": ["2", 0], "seed": 42, "steps": 40, "true_cfg_scale": 1.0,
        "width": 0, "height": 0, "batch_size": 1, "schedule": "default", "sigmas": "", "denoise": 1.0,
        "prefix_cache": True, "decode_graphs": True, "kv_cache": "bf16", "kv_placement": "auto",
        "compile_blocks": False, "parallel": "auto",
    }  # fmt: skip
    values.update(inputs)
    return {"class_type": "Qwen21Sampler", "inputs": values}


def _decode(**inputs) -> dict:
    values = {"model": ["1", 0], "latent": ["3", 0], "tiling": "auto", "tile_size": 0, "precision": "auto"}
    values["quality"] = "exact"
    values.update(inputs)
    return {"class_type": "Qwen21VAEDecode", "inputs": values}


def _save(prefix: str, images=("4", 0)) -> dict:
    return {"class_type": "Qwen21SaveImage", "inputs": {"images": list(images), "filename_prefix": f"qwen21/{prefix}"}}


def _load_image(name: str) -> dict:
    return {"class_type": "LoadImage", "inputs": {"image": name}}


KSAMPLER_NOTE = f"""{MODEL_NOTE}

**KSampler with our engine.** The loader's `MODEL` and `VAE` outputs are ComfyUI's own types on the same
weights, and *Qwen21 Encode*'s `positive`, `negative` and `latent` outputs feed *KSampler* directly: the prompt and
reference prefix is computed once per conditioning, decode steps replay from CUDA graphs, quantised weights stay
quantised. Any sampler and scheduler works; for the released schedule at every size use *Qwen21 Scheduler* with
*SamplerCustomAdvanced* (KSampler's `simple` matches it at 1024x1024 except the last steps). cfg 1 is the released
default: the negative prompt is then never encoded. *VAE Decode* gives an RGB image (*Qwen21 VAE Decode* gives the
alpha as a MASK too)."""

KSAMPLER_LORA_NOTE = f"""{KSAMPLER_NOTE}

Plus a Qwen-Image-2.1 **turbo** LoRA in `ComfyUI/models/loras/` (this workflow names it `{TURBO_LORA}`): ComfyUI's
*LoraLoaderModelOnly* puts it on the MODEL, and loading merges it into the weights through the pack's merge
(requantised into fp8 / int8 / int8_convrot, taken out bit for bit when it changes), so steps cost what they cost
without it. 8 steps: set the step count your LoRA was distilled for."""


CONTROL_FILE = "Qwen-Image-2.1-Fun-Controlnet-Union.safetensors"

CONTROL_NOTE = f"""{MODEL_NOTE}

Plus the **Fun-Controlnet-Union** branch for Qwen-Image-2.1 (alibaba-pai's `{CONTROL_FILE}`, or ComfyUI's repack of
it) in `ComfyUI/models/model_patches/` (or `models/controlnet/`). *Qwen21 Apply Fun Control* takes a control image
(canny, depth, pose, lineart, HED, MLSD, scribble, grayscale: make one with any preprocessor node) and/or a mask with
the image to inpaint (mask 1 = regenerate: *Load Image* gives the painted-out alpha as that mask). The branch's
prompt rows are computed once per prompt and its steps replay from CUDA graphs like plain ones; `start_percent` /
`end_percent` limit it to part of the schedule."""


def _control_loader(model=("1", 0)) -> dict:
    inputs = {"model": list(model), "control_name": CONTROL_FILE, "weight_dtype": "auto"}
    return {"class_type": "Qwen21ControlLoader", "inputs": inputs, "_meta": {"title": "Load Fun Control"}}


def _apply_control(kind: str = "Qwen21ApplyControl", model=("1", 0), **images) -> dict:
    inputs = {"model": list(model), "control": ["7", 0], "strength": 1.0, "start_percent": 0.0, "end_percent": 1.0,
              **images}  # fmt: skip
    return {"class_type": kind, "inputs": inputs}


def _ksampler(model=("1", 1), steps: int = 40) -> dict:
    inputs = {"model": list(model), "seed": 42, "steps": steps, "cfg": 1.0, "sampler_name": "euler",
              "scheduler": "simple", "positive": ["2", 3], "negative": ["2", 4], "latent_image": ["2", 5],
              "denoise": 1.0}  # fmt: skip
    return {"class_type": "KSampler", "inputs": inputs}


def _ksampler_tail(prefix: str) -> dict:
    """VAE Decode with the loader's VAE, and ComfyUI's Save Image."""
    return {
        "4": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["1", 2]}},
        "5": {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": f"qwen21/{prefix}"}},
    }


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
                        "text_encoder_dtype": "same",
                        "device": "auto",
                        "offload_text_encoder": "auto",
                        "text_encoder_device": "auto",
                        "vae_device": "auto",
                        "gpus": 1,
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
        "turbo_lora": (
            {
                "1": _loader(),
                "6": {
                    "class_type": "Qwen21LoraLoader",
                    "inputs": {"model": ["1", 0], "lora_name": TURBO_LORA, "strength": 1.0, "mode": "merge"},
                    "_meta": {"title": "Load turbo LoRA"},
                },
                "2": _encode(T2I_PROMPT, model=["6", 0]),
                "3": _sampler(model=["6", 0], steps=8),
                "4": _decode(model=["6", 0]),
                "5": _save("turbo_lora"),
            },
            TURBO_LORA_NOTE,
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
        "ksampler_text_to_image": (
            {"1": _loader(), "2": _encode(T2I_PROMPT), "3": _ksampler(), **_ksampler_tail("ksampler_text_to_image")},
            KSAMPLER_NOTE,
        ),
        "ksampler_edit_1_reference": (
            {
                "1": _loader(),
                "11": _load_image("reference_1.png"),
                "2": _encode("Make it a watercolor painting; keep the composition", image_1=["11", 0]),
                "3": _ksampler(),
                **_ksampler_tail("ksampler_edit_1_reference"),
            },
            KSAMPLER_NOTE,
        ),
        "control_canny": (
            {
                "1": _loader(),
                "11": _load_image("control_edges.png"),
                "7": _control_loader(),
                "8": _apply_control(control_image=["11", 0]),
                "2": _encode("A glass teapot on a wooden table by a window, morning light, photograph"),
                "3": _sampler(model=["8", 0]),
                "4": _decode(),
                "5": _save("control_canny"),
            },
            CONTROL_NOTE,
        ),
        "inpaint": (
            {
                "1": _loader(),
                "11": _load_image("inpaint_room.png"),
                "7": _control_loader(),
                "8": _apply_control(inpaint_image=["11", 0], mask=["11", 1]),
                "2": _encode("A tall green plant in a terracotta pot"),
                "3": _sampler(model=["8", 0]),
                "4": _decode(),
                "5": _save("inpaint"),
            },
            CONTROL_NOTE,
        ),
        "ksampler_control": (
            {
                "1": _loader(),
                "11": _load_image("control_edges.png"),
                "7": _control_loader(),
                "8": _apply_control("Qwen21ApplyControlModel", model=("1", 1), control_image=["11", 0]),
                "2": _encode("A glass teapot on a wooden table by a window, morning light, photograph"),
                "3": _ksampler(model=("8", 0)),
                **_ksampler_tail("ksampler_control"),
            },
            CONTROL_NOTE + "\n\n**Through KSampler**: *Qwen21 Apply Fun Control (MODEL)* puts the same branch on the "
            "loader's `MODEL` (after ComfyUI's LoRA loaders too).",
        ),
        "ksampler_lora": (
            {
                "1": _loader(),
                "6": {
                    "class_type": "LoraLoaderModelOnly",
                    "inputs": {"model": ["1", 1], "lora_name": TURBO_LORA, "strength_model": 1.0},
                    "_meta": {"title": "Load turbo LoRA (ComfyUI)"},
                },
                "2": _encode(T2I_PROMPT),
                "3": _ksampler(model=("6", 0), steps=8),
                **_ksampler_tail("ksampler_lora"),
            },
            KSAMPLER_LORA_NOTE,
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
    edges = Image.new("RGB", (256, 256), (0, 0, 0))  # a canny-like edge map: white lines on black
    draw = ImageDraw.Draw(edges)
    draw.line([(20, 190), (236, 190)], fill=(255, 255, 255), width=2)  # the table's edge
    draw.ellipse([78, 92, 178, 184], outline=(255, 255, 255), width=2)  # the pot
    draw.arc([160, 112, 212, 160], 270, 90, fill=(255, 255, 255), width=2)  # its handle
    draw.line([(84, 120), (50, 100)], fill=(255, 255, 255), width=2)  # its spout
    draw.rectangle([112, 80, 144, 92], outline=(255, 255, 255), width=2)  # its lid
    draw.rectangle([180, 20, 246, 90], outline=(255, 255, 255), width=2)  # the window
    hole = room.convert("RGBA")  # the room with a transparent hole: Load Image's mask is 1 (regenerate) there
    ImageDraw.Draw(hole).rectangle([30, 60, 110, 150], fill=(0, 0, 0, 0))
    return {
        "control_edges.png": edges,
        "inpaint_room.png": hole,
        "reference_1.png": room,
        "reference_2.png": lamp,
        "reference_3.png": chair,
        "reference_4.png": plant,
        "rgba_subject.png": subject,
    }


# --------------------------------------------------------------------------------------------------
# Thumbnails: ComfyUI's template browser shows workflows/<name>.jpg beside workflows/<name>.json
# (the frontend asks for /api/workflow_templates/<pack folder>/<name>.jpg). Each is a picture of the
# workflow itself: its title, a line saying what sets it apart, and its graph as a flow chart with the
# input pictures in the Load Image nodes; a workflow added to workflows() gets one on the next build.

THUMBNAIL_SIZE = 400
THUMBNAIL_QUALITY = 90
THUMBNAIL_STYLE = 1  # bump when draw_thumbnail changes, so that --check asks for new thumbnails
LINK_COLORS = {
    "QWEN21_MODEL": (178, 132, 240),
    "QWEN21_CONDITIONING": (245, 176, 82),
    "LATENT": (255, 128, 176),
    "IMAGE": (100, 182, 245),
    "MASK": (120, 214, 136),
    "QWEN21_CONTROL": (236, 120, 96),
}
TITLE_WORDS = {"rgba": "RGBA", "vae": "VAE", "lora": "LoRA", "ksampler": "KSampler", "canny": "(canny)"}


def _title(name: str) -> str:
    """text_to_image -> "Text to image", rgba_in_out -> "RGBA in out"."""
    title = " ".join(TITLE_WORDS.get(word, word) for word in name.split("_"))
    return title[0].upper() + title[1:]


def _checkerboard(size: tuple[int, int], cell: int = 6) -> Image.Image:
    board = Image.new("RGB", size, (205, 205, 205))
    draw = ImageDraw.Draw(board)
    for y in range(0, size[1], cell):
        for x in range((y // cell) % 2 * cell, size[0], 2 * cell):
            draw.rectangle([x, y, x + cell - 1, y + cell - 1], fill=(150, 150, 150))
    return board


def _summary(prompt: dict) -> str:
    """One line of what the workflow does differently: steps or schedule, references, batch, VAE path."""
    inputs = {node["class_type"]: node["inputs"] for node in prompt.values()}
    sampler, encoder = inputs.get("Qwen21Sampler", {}), inputs.get("Qwen21Encode", {})
    parts = []
    if sampler:
        parts.append(f"{sampler['steps']} steps" + (" turbo" if sampler["schedule"] == "turbo" else ""))
    if "KSampler" in inputs:
        parts.append(f"KSampler, {inputs['KSampler']['steps']} steps")
    if "LoraLoaderModelOnly" in inputs:
        parts.append("ComfyUI LoRA loader")
    for kind in ("Qwen21ApplyControl", "Qwen21ApplyControlModel"):
        if kind in inputs:
            parts.append("inpainting" if "mask" in inputs[kind] else "Fun-Control")
    if encoder:
        images = sum(name.startswith("image_") for name in encoder)
        parts.append(f"{images} reference{'s' * (images != 1)}" if images else "text only")
        if any(name.startswith("mask_") for name in encoder):
            parts.append("alpha in and out")
    if sampler.get("batch_size", 1) > 1:
        parts.append(f"batch {sampler['batch_size']}")
    if "Qwen21VAEDecode" in inputs:
        parts.append(f"{inputs['Qwen21VAEDecode']['quality']} VAE")
    return " · ".join(parts)


def _label(node: dict) -> str:
    short = {"Qwen21ModelLoader": "Load", "Qwen21DiffusersLoader": "Load", "Qwen21Sampler": "Sample"}
    short.update(Qwen21VAEDecode="Decode", Qwen21SaveImage="Save", JoinImageWithAlpha="Join", VAEDecode="Decode",
                 SaveImage="Save", LoraLoaderModelOnly="LoRA", Qwen21ControlLoader="Control",
                 Qwen21ApplyControl="Apply", Qwen21ApplyControlModel="Apply")  # fmt: skip
    return short.get(node["type"], node["type"].removeprefix("Qwen21").removesuffix("Loader") or "Load")


def draw_thumbnail(name: str, ui: dict, prompt: dict, pictures: dict[str, Image.Image]) -> Image.Image:
    """The workflow as a flow chart: a column per graph depth (as the canvas lays it out), a box per node
    (the Load Image nodes showing their picture), the links coloured by type."""
    side, margin = THUMBNAIL_SIZE, 16
    card = Image.new("RGB", (side, side), (30, 33, 40))
    draw = ImageDraw.Draw(card)
    draw.text((margin + 4, 16), "Qwen-Image-2.1", fill=(150, 160, 178), font=ImageFont.load_default(size=20))
    draw.text((margin + 4, 40), _title(name), fill=(242, 242, 248), font=ImageFont.load_default(size=32))
    draw.text((margin + 4, 82), _summary(prompt), fill=(196, 200, 214), font=ImageFont.load_default(size=16))

    nodes = [node for node in ui["nodes"] if node["type"] != "MarkdownNote"]
    xs = sorted({node["pos"][0] for node in nodes})
    columns: dict[int, list[dict]] = {}
    for node in sorted(nodes, key=lambda n: n["pos"][1]):
        columns.setdefault(xs.index(node["pos"][0]), []).append(node)
    gap = 18
    box_w = (side - 2 * margin - gap * (len(xs) - 1)) / len(xs)
    top, bottom = 122, side - margin
    rows = max(len(column) for column in columns.values())
    box_h = min(box_w * 0.9, (bottom - top - 8 * (rows - 1)) / rows)
    chart_h = rows * box_h + 8 * (rows - 1)
    boxes = {}
    for column, members in columns.items():
        x0 = margin + column * (box_w + gap)
        y = top + (bottom - top - chart_h) / 2
        for node in members:
            boxes[node["id"]] = (x0, y, x0 + box_w, y + box_h)
            y += box_h + 8

    def edge(node_id: int, index: int, count: int, output: bool) -> tuple[float, float]:
        x0, y0, x1, y1 = boxes[node_id]
        return (x1 if output else x0), y0 + (y1 - y0) * (index + 1) / (count + 1)

    for _link, source, slot, target, target_slot, kind in ui["links"]:
        sources = [link[2] for link in ui["links"] if link[1] == source]
        targets = sorted(link[4] for link in ui["links"] if link[3] == target)
        ax, ay = edge(source, sorted(set(sources)).index(slot), len(set(sources)), True)
        bx, by = edge(target, targets.index(target_slot), len(targets), False)
        bend = (bx - ax) / 2
        curve = []
        for i in range(25):  # a cubic Bezier, as the canvas draws links
            t, u = i / 24, 1 - i / 24
            x = u**3 * ax + 3 * u * u * t * (ax + bend) + 3 * u * t * t * (bx - bend) + t**3 * bx
            curve.append((x, u**3 * ay + 3 * u * u * t * ay + 3 * u * t * t * by + t**3 * by))
        draw.line(curve, fill=LINK_COLORS.get(kind, (190, 190, 190)), width=2)

    font = ImageFont.load_default(size=12)
    for node in nodes:
        x0, y0, x1, y1 = boxes[node["id"]]
        bar = min(14.0, (y1 - y0) / 4)
        ours = node["type"].startswith("Qwen21")
        draw.rounded_rectangle([x0, y0, x1, y1], radius=4, fill=(56, 60, 72), outline=(18, 20, 24))
        draw.rounded_rectangle([x0, y0, x1, y0 + bar], radius=4, fill=(112, 82, 176) if ours else (82, 88, 102))
        picture = pictures.get(node["widgets_values"][0]) if node["type"] == "LoadImage" else None
        if picture is None:
            draw.text(((x0 + x1) / 2, (y0 + bar + y1) / 2), _label(node), fill=(232, 232, 240), font=font, anchor="mm")
            continue
        shown = picture.copy()
        shown.thumbnail((int(x1 - x0) - 6, int(y1 - y0 - bar) - 6))
        backdrop = _checkerboard(shown.size)
        backdrop.paste(shown, mask=shown.getchannel("A") if shown.mode == "RGBA" else None)
        card.paste(backdrop, (int((x0 + x1 - shown.width) / 2), int((y0 + bar + y1 - shown.height) / 2)))
    return card


def render_thumbnails(files: dict[Path, dict]) -> dict[Path, tuple[Image.Image, str]]:
    """workflows/<name>.jpg for every UI workflow among `files` (what render_workflows returns):
    the picture, and the fingerprint of what it was drawn from (stored in the JPEG's comment)."""
    pictures = input_images()
    drawn_from = [THUMBNAIL_STYLE] + [[name, hashlib.sha256(p.tobytes()).hexdigest()] for name, p in pictures.items()]
    thumbnails = {}
    for path, ui in files.items():
        if path.parent == HERE:
            prompt = files[HERE / "api" / path.name]
            source = json.dumps([path.stem, ui, prompt, drawn_from], sort_keys=True).encode()
            fingerprint = hashlib.sha256(source).hexdigest()
            thumbnails[path.with_suffix(".jpg")] = (draw_thumbnail(path.stem, ui, prompt, pictures), fingerprint)
    return thumbnails


def thumbnail_fingerprint(path: Path) -> str | None:
    """The fingerprint a saved thumbnail was drawn from; None if it is missing or no thumbnail of ours.
    (JPEG encoders differ a little, so a fingerprint, not the pixels, says whether it is current.)"""
    if not path.is_file():
        return None
    with Image.open(path) as saved:
        if saved.format != "JPEG" or saved.size != (THUMBNAIL_SIZE, THUMBNAIL_SIZE):
            return None
        return saved.info.get("comment", b"").decode() or None


# --------------------------------------------------------------------------------------------------


def render_workflows() -> dict[Path, dict]:
    """Every workflow file, path -> JSON content."""
    from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS
    from qwen21_nodes.runner.comfyui_only import NODES as COMFYUI_ONLY
    from qwen21_nodes.runner.core_nodes import make_core_nodes

    classes = {**COMFYUI_ONLY, **make_core_nodes(str(HERE / "input"), "", ""), **NODE_CLASS_MAPPINGS}
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
    files = render_workflows()
    for path, content in files.items():
        if not (path.is_file() and json.loads(path.read_text()) == content):
            stale.append(path)
            if not args.check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(content, indent=2) + "\n")
    for path, (picture, fingerprint) in render_thumbnails(files).items():
        if thumbnail_fingerprint(path) != fingerprint:
            stale.append(path)
            if not args.check:
                picture.save(path, quality=THUMBNAIL_QUALITY, optimize=True, comment=fingerprint)
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
