"""Our MODEL under ComfyUI's memory management on a GPU (ComfyUI 0.3.64 in-process, tests/comfyui_child.py): the case a
CPU cannot show, where ComfyUI sees no room for the DiT and the text encoder together. Skipped, saying why, without a
CUDA GPU or without COMFYUI_DIR."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

COMFYUI_DIR = os.environ.get("COMFYUI_DIR", "")
CHILD = Path(__file__).with_name("comfyui_child.py")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.comfyui,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU; this machine has none (run on the H200)"
    ),
    pytest.mark.skipif(
        not (COMFYUI_DIR and os.path.isfile(os.path.join(COMFYUI_DIR, "main.py"))),
        reason="set COMFYUI_DIR to a ComfyUI checkout (and COMFYUI_PYTHON to its interpreter)",
    ),
]


def run_child(tmp_path, checks):
    import qwen21_nodes

    packages = tmp_path / "packages"
    packages.mkdir()
    (packages / "qwen21_nodes").symlink_to(Path(qwen21_nodes.__file__).parent)
    python = os.environ.get("COMFYUI_PYTHON") or sys.executable
    path = os.pathsep.join(filter(None, [str(packages), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([python, "-P", str(CHILD), COMFYUI_DIR, str(tmp_path), ",".join(checks), "cuda"],
                          env={**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    found = {line["check"]: line for line in map(json.loads, filter(lambda s: s.startswith("{"),
                                                                    done.stdout.splitlines()))}  # fmt: skip
    assert done.returncode == 0 and set(found) == set(checks), done.stdout[-3000:] + done.stderr[-5000:]
    return found


def test_ksampler_on_a_card_without_room_for_both_models_keeps_the_dit_on_the_gpu(tmp_path):
    line = run_child(tmp_path, ["small_card"])["small_card"]
    assert "failed" not in line, line.get("failed")
    assert line["errors"] == {} and line["devices"] == ["cuda:0"] and line["calls"] >= 6, line  # every call, both runs
    assert line["effect"] > 1e-3  # cfg 4 differs from cfg 1: the negative was used
    assert line["difference"] == {"cfg1": 0.0, "cfg4": 0.0}, line  # the uncapped run's latents, bit for bit


def test_ksampler_on_a_gguf_model_on_a_card_without_room_for_both_keeps_its_dit_on_the_gpu(tmp_path):
    """The same with the GGUF DiT (its blocks as stored): the 8 GB card's case."""
    line = run_child(tmp_path, ["small_card_gguf"])["small_card_gguf"]
    assert "failed" not in line, line.get("failed")
    assert line["errors"] == {} and line["devices"] == ["cuda:0"] and line["calls"] >= 6, line
    assert line["effect"] > 1e-3 and line["difference"] == {"cfg1": 0.0, "cfg4": 0.0}, line


def test_a_partly_loaded_text_encoder_encodes_where_it_is(tmp_path):
    """The text encoder half placed by ComfyUI's manager (as on a card without room for both models after sampling)
    encodes without a load through the manager (which would evict the DiT for it), its other layers streamed, and
    gives the embeddings of the whole encoder bit for bit."""
    line = run_child(tmp_path, ["encoder_in_place"])["encoder_in_place"]
    assert "failed" not in line, line.get("failed")
    assert line["placed"] > 0 and line["resident"] < line["layers"], line  # on the GPU, some layers streamed
    assert line["encoder_loads"] == 0 and line["difference"] == 0.0, line


def test_fun_control_through_comfyuis_samplers_on_the_gpu(tmp_path):
    """The control checks of test_comfyui_types on the GPU, the nodes run under inference mode as ComfyUI's executor
    runs them: the branch loaded there and placed on the GPU by ComfyUI's manager must run (every controlled prompt
    failed at its first step once, "Inference tensors do not track version counter", which the CPU never showed), and
    give Qwen21 Sampler's latents; native's patches run as ours."""
    found = run_child(tmp_path, ["control", "native_control"])
    line = found["control"]
    assert "failed" not in line, line.get("failed")
    assert line["parity"] <= 1e-4 and line["apply_model_output"] <= 1e-4 and line["effect"] > 1e-2, line
    assert line["off_to_plain"] == 0.0 and line["status_control"] == "3/3 calls at strength 1", line
    memory = line["memory"]
    assert memory["off"] == memory["plain"] and memory["plain"][0] < memory["control"][0] < memory["both_sides"][0]
    native = found["native_control"]
    assert "failed" not in native, native.get("failed")
    assert native["parity"] <= 1e-6 and native["native_hooks_called"] == 0, native
