"""README's two commands work from the clone's root, as a new user runs them.

The clone's root holds our `kernels/` package, and PyPI has a `kernels` package that transformers (5.25 and later)
imports. A command that makes the clone an import root (`python -m ...`, `python -c ...` run there) gets ours and
fails to import transformers. These tests run the commands' runners from the root, exactly as README writes them,
and check which `kernels` the processes see. `.ci/run` runs README's test command, checked here too.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUR_KERNELS = ROOT / "kernels"
TIMEOUT_S = 600


def readme_commands() -> tuple[str, str]:
    """The fenced commands of README's 'Fresh machine: two commands': (install + demo, install + tests)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    heading = re.search(r"^## Fresh machine.*$", text, re.M)
    assert heading, "README has no '## Fresh machine' section"
    section = text[heading.end():].split("\n## ", 1)[0]
    blocks = [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]
    assert len(blocks) == 2, f"README's 'Fresh machine' section should hold two commands, found {len(blocks)}"
    return blocks[0], blocks[1]


def runner(command: str) -> list[str]:
    """What a command runs once its installs are done: the part after its last `&&`."""
    return shlex.split(command.split("&&")[-1])


def run_from_root(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`argv` from the clone's root, with this interpreter's scripts first on PATH (as an activated venv does)."""
    scripts = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
           "CUDA_VISIBLE_DEVICES": "", "QWEN21_KERNEL_WARMUP": "0", "TMPDIR": str(tmp_path)}  # fmt: skip
    env.pop("PYTHONPATH", None)
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_readme_commands_use_entry_points_that_keep_the_root_off_sys_path():
    demo, tests = readme_commands()
    assert runner(demo)[:2] == ["qwen21-nodes", "demo"], demo
    assert runner(tests)[0] == "pytest", tests
    for command in (demo, tests):
        assert not re.search(r"\bpython3? +-[mc]\b", command.split("&&")[-1]), f"{command}: runs from the root"


def test_ci_runs_the_readme_test_command_exactly():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert readme_commands()[1] in ci.splitlines(), ".ci/run must run README's test command as README writes it"


def test_the_readme_demo_runs_from_the_clone_root(tmp_path):
    """Failed with transformers 5.25 before the entry point: `python -m qwen21_nodes demo` imported our kernels/."""
    argv = runner(readme_commands()[0])
    argv += ["--tiny-dir", str(tmp_path / "tiny"), "--output-dir", str(tmp_path / "out")]
    done = run_from_root(argv, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "qwen21" / "text_to_image_00001_.png").is_file()


PROBE = """
import importlib.util
from pathlib import Path


def test_kernels_is_not_the_clones():
    import transformers.activations  # imports PyPI's `kernels` where transformers depends on it

    spec = importlib.util.find_spec("kernels")
    origin = Path(spec.origin).resolve() if spec and spec.origin else None
    assert origin is None or Path({ours!r}) not in origin.parents, origin
"""


def test_the_readme_test_command_collects_from_the_clone_root(tmp_path):
    """Failed with transformers 5.25 before `pytest` replaced `python -m pytest`: ten files failed to collect.
    A probe checks which `kernels` a test sees; the text encoder's tests import transformers' Qwen3-VL."""
    probe = tmp_path / "test_probe_kernels.py"
    probe.write_text(PROBE.format(ours=str(OUR_KERNELS)))
    argv = runner(readme_commands()[1])
    done = run_from_root([*argv, "-p", "no:cacheprovider", str(probe)], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    done = run_from_root([*argv, "-p", "no:cacheprovider", "--collect-only", "tests/test_text_encoder.py"], tmp_path)
    assert done.returncode == 0 and "tests collected" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]


@pytest.mark.parametrize("module", ["qwen21_nodes", "pytest"])
def test_python_dash_m_from_the_root_works_too(module, tmp_path):
    """`python -m qwen21_nodes` and `python -m pytest` typed by habit from the clone: the package's __main__ and
    tests/conftest.py take the clone off sys.path before anything imports transformers (make-tiny writes the
    tokenizer with it; the text encoder's tests import its Qwen3-VL when collected)."""
    if module == "qwen21_nodes":
        argv = [sys.executable, "-m", "qwen21_nodes", "make-tiny", str(tmp_path / "tiny")]
    else:
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                "tests/test_text_encoder.py"]  # fmt: skip
    done = run_from_root(argv, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
