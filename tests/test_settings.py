"""The pack's QWEN21_* switches (kernels/settings.py): every one parsed once, into typed fields; a bad value is one
ValueError naming the variable, its value and what is expected; the rest of the pack reads no environment; README
documents exactly these variables in one table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen21_nodes.kernels import settings

REPO = Path(__file__).resolve().parent.parent

EVERY_VARIABLE_SET = {
    "QWEN21_KERNEL_WARMUP": "0",
    "QWEN21_KERNEL_WARMUP_THREADS": "3",
    "QWEN21_AUTOTUNE": "1",
    "QWEN21_FAST_LAUNCH": "0",
    "QWEN21_QUANT_GEMM": "emulate",
    "QWEN21_PARALLEL_TIMEOUT": "12.5",
    "QWEN21_PARALLEL_LOAD_TIMEOUT": " 60 ",
    "QWEN21_MODELS": "/data/models",
    "QWEN21_CONTROL_STREAM": "1",
    "QWEN21_GGUF_PREFETCH": "1",
}


def test_unset_variables_give_the_defaults():
    assert settings.read({}) == settings.Settings()
    assert settings.read({name: "" for name in EVERY_VARIABLE_SET}) == settings.Settings()  # empty means unset
    defaults = settings.Settings()
    assert defaults.kernel_warmup is True and defaults.autotune is False and defaults.fast_launch is None
    assert defaults.kernel_warmup_threads is None and defaults.quant_gemm is None and defaults.models_dir is None
    assert defaults.control_stream is False and defaults.gguf_prefetch is False
    assert (defaults.parallel_timeout_s, defaults.parallel_load_timeout_s) == (300.0, 1800.0)


def test_every_variable_parses_into_its_typed_field():
    parsed = settings.read(EVERY_VARIABLE_SET)
    assert parsed == settings.Settings(kernel_warmup=False, kernel_warmup_threads=3, autotune=True, fast_launch=False,
                                       quant_gemm="emulate", parallel_timeout_s=12.5, parallel_load_timeout_s=60.0,
                                       models_dir="/data/models", control_stream=True,
                                       gguf_prefetch=True)  # fmt: skip
    assert {variable for variable, _ in settings.VARIABLES.values()} == set(EVERY_VARIABLE_SET)


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("QWEN21_KERNEL_WARMUP", "off", "0 or 1"),
        ("QWEN21_KERNEL_WARMUP_THREADS", "0", "a whole number > 0"),
        ("QWEN21_KERNEL_WARMUP_THREADS", "two", "a whole number > 0"),
        ("QWEN21_AUTOTUNE", "yes", "0 or 1"),
        ("QWEN21_FAST_LAUNCH", "2", "0 or 1"),
        ("QWEN21_CONTROL_STREAM", "on", "0 or 1"),
        ("QWEN21_QUANT_GEMM", "scaled_mm", "weight_only or emulate"),
        ("QWEN21_PARALLEL_TIMEOUT", "-5", "a number of seconds > 0"),
        ("QWEN21_PARALLEL_LOAD_TIMEOUT", "nan", "a number of seconds > 0"),
    ],
)
def test_a_bad_value_is_a_value_error_naming_the_variable_the_value_and_what_is_expected(variable, value, expected):
    with pytest.raises(ValueError) as raised:
        settings.read({variable: value})
    message = str(raised.value)
    assert f"{variable}={value!r}" in message and expected in message


def test_every_bad_variable_is_named_in_the_one_error():
    with pytest.raises(ValueError, match=r"QWEN21_AUTOTUNE='on'.*QWEN21_PARALLEL_TIMEOUT='soon'"):
        settings.read({"QWEN21_AUTOTUNE": "on", "QWEN21_PARALLEL_TIMEOUT": "soon", "QWEN21_FAST_LAUNCH": "1"})


def test_the_environment_is_read_once_and_kept(monkeypatch):
    reads = []
    real = settings.read
    monkeypatch.setattr(settings, "read", lambda environ=None: reads.append(1) or real(environ))
    monkeypatch.setattr(settings, "_current", None)
    monkeypatch.setenv("QWEN21_AUTOTUNE", "1")
    first = settings.current()
    monkeypatch.setenv("QWEN21_AUTOTUNE", "0")  # a change after the first use changes nothing
    assert settings.current() is first and first.autotune is True and reads == [1]
    settings.reset()
    assert settings.current().autotune is False and reads == [1, 1]


def test_a_bad_value_fails_every_use_until_it_is_fixed(monkeypatch):
    monkeypatch.setattr(settings, "_current", None)
    monkeypatch.setenv("QWEN21_KERNEL_WARMUP_THREADS", "many")
    for _ in range(2):
        with pytest.raises(ValueError, match="QWEN21_KERNEL_WARMUP_THREADS='many'"):
            settings.current()
    monkeypatch.setenv("QWEN21_KERNEL_WARMUP_THREADS", "2")
    assert settings.current().kernel_warmup_threads == 2


def test_replace_and_use_change_the_kept_settings(monkeypatch):
    monkeypatch.setattr(settings, "_current", settings.Settings())
    before = settings.replace(autotune=True)
    assert settings.current().autotune is True and before.autotune is False
    settings.use(before)
    assert settings.current() is before


def test_a_bad_value_does_not_break_the_packs_import():
    """Nothing is parsed at import: ComfyUI loads the pack, and the first use (a model's load) names the problem."""
    code = "import qwen21_nodes.nodes as n; print(len(n.NODE_CLASS_MAPPINGS))"
    env = {**_plain_env(), "QWEN21_QUANT_GEMM": "fastest"}
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) > 0 and "QWEN21_QUANT_GEMM" not in done.stderr


def _plain_env() -> dict:
    return {name: value for name, value in os.environ.items() if not name.startswith("QWEN21_")}


def test_no_module_but_the_settings_and_the_worker_bootstrap_reads_the_environment():
    """grep -rn os.environ qwen21_core kernels nodes runner: kernels/settings.py, the worker's start (worker.py), the
    worker's environment as rank 0 builds it (pool.py), and torch's NCCL switch held while rank 0's group is
    constructed (group.py: torch has no option for it)."""
    allowed = {"kernels/settings.py", "qwen21_core/parallel/worker.py", "qwen21_core/parallel/pool.py",
               "qwen21_core/parallel/group.py"}  # fmt: skip
    readers = set()
    for folder in ("qwen21_core", "kernels", "nodes", "runner"):
        for path in (REPO / folder).rglob("*.py"):
            if re.search(r"os\.environ|getenv", path.read_text()):
                readers.add(path.relative_to(REPO).as_posix())
    assert readers <= allowed, sorted(readers - allowed)


def test_readme_documents_every_variable_in_one_table():
    text = (REPO / "README.md").read_text()
    section = re.search(r"^## Settings \(environment variables\)\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "README.md has no '## Settings (environment variables)' section"
    rows = re.findall(r"^\| `(QWEN21_\w+)`", section.group(1), re.M)
    assert sorted(rows) == sorted(variable for variable, _ in settings.VARIABLES.values())


def test_rank_zero_holds_torchs_nccl_switch_only_while_its_group_is_constructed(monkeypatch):
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=0 keeps torch's NCCL watchdog from tearing ComfyUI's process down; torch reads
    it in the group's constructor and has no option for it, so it is set there and ComfyUI's value comes back."""
    import torch.distributed as dist
    from qwen21_nodes.qwen21_core.parallel import group

    seen = []
    monkeypatch.setattr(dist, "init_process_group",
                        lambda *args, **kwargs: seen.append(os.environ.get(group.NCCL_ERROR_HANDLING)))  # fmt: skip
    for before in (None, "3"):
        if before is None:
            monkeypatch.delenv(group.NCCL_ERROR_HANDLING, raising=False)
        else:
            monkeypatch.setenv(group.NCCL_ERROR_HANDLING, before)
        group.join(dist.HashStore(), 1, 0, 2, "nccl", torch.device("cuda", 0), 5.0)
        assert os.environ.get(group.NCCL_ERROR_HANDLING) == before
    group.join(dist.HashStore(), 2, 0, 2, "gloo", torch.device("cpu"), 5.0)
    assert seen == ["0", "0", "3"]  # gloo: left as it is
