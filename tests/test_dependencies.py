"""What a new user's install asks for: pyproject's dependencies, and requirements.txt (what ComfyUI users install
into ComfyUI's own Python) asking for the same, without torch or torchvision, and without touching what ComfyUI pins.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMFYUI_OWNS = {"torch", "torchvision"}  # the pack uses ComfyUI's own; requirements.txt never upgrades them


def _requirements(lines) -> dict[str, str]:
    """name (normalised) -> specifier, from requirement lines (comments and blanks skipped)."""
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name, spec = re.match(r"([A-Za-z0-9_.\-]+)\s*(.*)", line).groups()
            found[re.sub(r"[-_.]+", "-", name).lower()] = spec.replace(" ", "")
    return found


def project_dependencies() -> dict[str, str]:
    return _requirements(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def requirements_txt() -> dict[str, str]:
    return _requirements((ROOT / "requirements.txt").read_text().splitlines())


def test_requirements_txt_asks_for_what_the_package_needs_except_comfyuis_torch():
    project = project_dependencies()
    assert COMFYUI_OWNS <= project.keys()
    assert requirements_txt() == {name: spec for name, spec in project.items() if name not in COMFYUI_OWNS}


def test_no_upper_bounds_without_a_known_break():
    """README: no newer major version is known to break the pack, so nothing is capped (a cap would downgrade a
    ComfyUI venv's packages for nothing). A future cap must come with README's reason and this test changed."""
    capped = {name: spec for name, spec in {**project_dependencies(), **requirements_txt()}.items()
              if "<" in spec or "==" in spec or "~=" in spec}  # fmt: skip
    assert not capped


@pytest.mark.comfyui
@pytest.mark.skipif(not os.environ.get("COMFYUI_DIR"), reason="set COMFYUI_DIR to a ComfyUI checkout to compare")
def test_requirements_leave_what_comfyui_pins_alone():
    """Nothing ComfyUI pins (==) or owns (torch, torchvision) is in our requirements: installing them into ComfyUI's
    Python can move only packages ComfyUI leaves open."""
    theirs = _requirements((Path(os.environ["COMFYUI_DIR"]) / "requirements.txt").read_text().splitlines())
    ours = requirements_txt()
    pinned = {name for name, spec in theirs.items() if spec.startswith("==")}
    assert not (pinned | COMFYUI_OWNS) & ours.keys()
    assert {"transformers", "safetensors", "numpy", "pillow", "tokenizers"} <= theirs.keys()  # read the right file
