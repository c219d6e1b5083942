"""The pack imports the way ComfyUI imports it: from a copy under another folder name, by file path,
with the folder name as the package name, in a process where `qwen21_nodes` was never imported."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXPECTED_NODES = {
    "Qwen21ControlLoader",
    "Qwen21ApplyControl",
    "Qwen21ApplyControlModel",
    "Qwen21ModelLoader",
    "Qwen21DiffusersLoader",
    "Qwen21Encode",
    "Qwen21Sampler",
    "Qwen21Scheduler",
    "Qwen21EmptyLatent",
    "Qwen21VAEDecode",
    "Qwen21VAEEncode",
    "Qwen21LoraLoader",
    "Qwen21SaveImage",
}

# What ComfyUI's load_custom_node does (nodes.py): spec_from_file_location(<folder name>, <folder>/__init__.py).
IMPORT_LIKE_COMFYUI = """
import importlib.util, json, os, sys
folder = sys.argv[1]
name = os.path.basename(folder)
before = set(sys.modules)
spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"))
module = importlib.util.module_from_spec(spec)
sys.modules[name] = module
spec.loader.exec_module(module)
added = sorted(set(sys.modules) - before)
print(json.dumps({
    "nodes": sorted(module.NODE_CLASS_MAPPINGS),
    "display": module.NODE_DISPLAY_NAME_MAPPINGS,
    "web": module.WEB_DIRECTORY,
    "categories": sorted({c.CATEGORY for c in module.NODE_CLASS_MAPPINGS.values()}),
    "own_modules_outside_package": [m for m in added if m.split(".")[0] in ("nodes", "runner", "kernels",
                                    "qwen21_core", "qwen21_nodes")],
    "sys_path_changed": sys.path != json.loads(sys.argv[2]),
}))
"""


def test_pack_imports_from_a_renamed_copy_like_comfyui(tmp_path):
    copy = tmp_path / "custom_nodes" / "Qwen21-Pack_renamed"
    shutil.copytree(
        REPO, copy, ignore=shutil.ignore_patterns(".git", ".venv", "tests", "__pycache__", "*.egg-info", "output")
    )
    probe = "import json, sys; print(json.dumps(sys.path))"
    base_path = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path).stdout
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_LIKE_COMFYUI, str(copy), base_path.strip()],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "failed to import" not in done.stderr, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(report["nodes"]) == EXPECTED_NODES
    assert set(report["display"]) == EXPECTED_NODES
    assert report["web"] == "./web"
    assert all(c == "Qwen21" or c.startswith("Qwen21/") for c in report["categories"])
    assert report["own_modules_outside_package"] == [], "imported a top-level module; imports must be relative"
    assert not report["sys_path_changed"], "the pack changed sys.path"


def test_every_node_has_a_help_page_and_tooltips():
    from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS

    assert set(NODE_CLASS_MAPPINGS) == EXPECTED_NODES, "a node module failed to import; see the log"
    for name, node_class in NODE_CLASS_MAPPINGS.items():
        page = REPO / "web" / "docs" / f"{name}.md"
        assert page.is_file(), f"missing help page {page}"
        text = page.read_text()
        declared = node_class.INPUT_TYPES()
        for section in ("required", "optional"):
            for input_name, spec in declared.get(section, {}).items():
                assert spec[1].get("tooltip"), f"{name}.{input_name} has no tooltip"
                stem = input_name.rstrip("0123456789").rstrip("_")
                assert stem in text, f"{page.name} does not mention the input {input_name!r}"
        assert node_class.CATEGORY.split("/")[0] == "Qwen21"
        assert node_class.DESCRIPTION and "\n    " not in node_class.DESCRIPTION  # no source indentation


# ComfyUI's real module name for a pack folder: its whole path, dots replaced (nodes.py load_custom_node).
# Every exception class in the pack is reported by ComfyUI as module + name (execution.full_type_name).
ERROR_NAMES_UNDER_A_PATH_NAME = """
import importlib, importlib.util, inspect, json, os, pkgutil, sys
folder = sys.argv[1]
name = folder.replace(".", "_x_")
spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"))
package = importlib.util.module_from_spec(spec)
sys.modules[name] = package
spec.loader.exec_module(package)
names = set()
comfyui_only = {name + ".nodes." + module for module in importlib.import_module(name + ".nodes").COMFYUI_ONLY_MODULES}
for info in pkgutil.walk_packages(package.__path__, name + "."):
    if info.name.endswith("__main__") or info.name in comfyui_only:  # these import ComfyUI: checked in ComfyUI
        continue
    module = importlib.import_module(info.name)
    for value in vars(module).values():
        if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ != "builtins":
            if value.__module__.startswith((name, "qwen21_nodes")):  # ours, not torch's or another library's
                names.add(value.__module__ + "." + value.__qualname__)
print(json.dumps(sorted(names)))
"""


def test_every_error_class_reports_the_package_name_not_the_folder_path(tmp_path):
    copy = tmp_path / "custom_nodes" / "qwen21.nodes-main"
    shutil.copytree(
        REPO, copy, ignore=shutil.ignore_patterns(".git", ".venv", "tests", "__pycache__", "*.egg-info", "output")
    )
    done = subprocess.run(
        [sys.executable, "-c", ERROR_NAMES_UNDER_A_PATH_NAME, str(copy)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    names = json.loads(done.stdout.strip().splitlines()[-1])
    assert "qwen21_nodes.qwen21_core.checkpoints.files.WrongModelError" in names, names
    leaked = [n for n in names if not n.startswith("qwen21_nodes.") or str(tmp_path) in n or "_x_" in n]
    assert leaked == [], "decorate these with qwen21_core.errors.stable_name"


def test_every_package_folder_is_listed_for_setuptools():
    """A non-editable `pip install .` installs only the packages pyproject.toml lists: a folder with an
    __init__.py missing there (qwen21_core.memory and .quant were) would be missing from the installed pack."""
    text = (REPO / "pyproject.toml").read_text()
    listed = set(re.findall(r'"([\w.]+)"', re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)))
    on_disk = {
        ".".join(("qwen21_nodes", *init.parent.relative_to(REPO).parts))
        for init in REPO.rglob("__init__.py")
        if not any(part.startswith(".") or part == "__pycache__" for part in init.relative_to(REPO).parts)
    }
    assert listed == on_disk
