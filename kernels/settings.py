"""Every `QWEN21_*` environment switch of the pack, read once, in one place.

    from ..kernels import settings          # kernels/
    from ..qwen21_core import settings      # everything above kernels/ (the same module, re-exported)
    if settings.current().autotune: ...

`current()` parses every variable the first time it is asked (a model's load, in practice: never at the pack's
import) and keeps the result for the life of the process; later calls return the kept `Settings`, so a switch costs
one call on a hot path, never an environment lookup. Set a variable before the process starts (ComfyUI's
environment); changing it afterwards changes nothing.

One error behaviour: a value that does not parse raises ValueError at that first use, naming every variable that is
wrong, its value and what is expected. A load then fails with that message (every later use asks again and fails the
same way) instead of running on a default the user did not choose.

Why here: kernels/ read some of these switches and import nothing above them (nodes -> qwen21_core -> kernels), so
the module lives in the lowest layer and qwen21_core/settings.py re-exports it for the layers above.

The pack also passes variables of its own to its worker processes (QWEN21_WORKER_*, QWEN21_PARALLEL_FUNCTIONS:
qwen21_core/parallel/pool.py builds the child's environment, worker.py reads it at the child's start). They are not
settings: nobody sets them by hand.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

KERNEL_WARMUP = "QWEN21_KERNEL_WARMUP"
KERNEL_WARMUP_THREADS = "QWEN21_KERNEL_WARMUP_THREADS"
AUTOTUNE = "QWEN21_AUTOTUNE"
FAST_LAUNCH = "QWEN21_FAST_LAUNCH"
QUANT_GEMM = "QWEN21_QUANT_GEMM"
PARALLEL_TIMEOUT = "QWEN21_PARALLEL_TIMEOUT"
PARALLEL_LOAD_TIMEOUT = "QWEN21_PARALLEL_LOAD_TIMEOUT"
MODELS = "QWEN21_MODELS"
CONTROL_STREAM = "QWEN21_CONTROL_STREAM"
GGUF_PREFETCH = "QWEN21_GGUF_PREFETCH"

QUANT_GEMM_CHOICES = ("weight_only", "emulate")


@dataclass(frozen=True)
class Settings:
    """The switches, typed; each field's default is what an unset variable means."""

    kernel_warmup: bool = True  # QWEN21_KERNEL_WARMUP
    kernel_warmup_threads: int | None = None  # QWEN21_KERNEL_WARMUP_THREADS; None: the pool's own default
    autotune: bool = False  # QWEN21_AUTOTUNE
    fast_launch: bool | None = None  # QWEN21_FAST_LAUNCH; None: on for the Triton versions it was tested with
    quant_gemm: str | None = None  # QWEN21_QUANT_GEMM; None: the best GEMM the device runs
    parallel_timeout_s: float = 300.0  # QWEN21_PARALLEL_TIMEOUT
    parallel_load_timeout_s: float = 1800.0  # QWEN21_PARALLEL_LOAD_TIMEOUT
    models_dir: str | None = None  # QWEN21_MODELS
    control_stream: bool = False  # QWEN21_CONTROL_STREAM
    gguf_prefetch: bool = False  # QWEN21_GGUF_PREFETCH


def _switch(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError("0 or 1")
    return raw == "1"


def _positive_int(raw: str) -> int:
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError("a whole number > 0")
    return int(raw)


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError("a number of seconds > 0, e.g. 300")
    return value


def _quant_gemm(raw: str) -> str:
    if raw not in QUANT_GEMM_CHOICES:
        raise ValueError(" or ".join(QUANT_GEMM_CHOICES))
    return raw


def _path(raw: str) -> str:
    return raw


# field -> (variable, parser of its stripped, non-empty value: raises ValueError saying what is expected); an empty or
# unset variable means the default
VARIABLES: dict[str, tuple[str, Callable[[str], object]]] = {
    "kernel_warmup": (KERNEL_WARMUP, _switch),
    "kernel_warmup_threads": (KERNEL_WARMUP_THREADS, _positive_int),
    "autotune": (AUTOTUNE, _switch),
    "fast_launch": (FAST_LAUNCH, _switch),
    "quant_gemm": (QUANT_GEMM, _quant_gemm),
    "parallel_timeout_s": (PARALLEL_TIMEOUT, _seconds),
    "parallel_load_timeout_s": (PARALLEL_LOAD_TIMEOUT, _seconds),
    "models_dir": (MODELS, _path),
    "control_stream": (CONTROL_STREAM, _switch),
    "gguf_prefetch": (GGUF_PREFETCH, _switch),
}
assert set(VARIABLES) == {f.name for f in dataclasses.fields(Settings)}


def read(environ: Mapping[str, str] | None = None) -> Settings:
    """Parse the switches from `environ` (default: the process's environment). Raises ValueError naming every
    variable whose value does not parse, with the value and what is expected."""
    environ = os.environ if environ is None else environ
    values, errors = {}, []
    for name, (variable, parse) in VARIABLES.items():
        raw = environ.get(variable, "").strip()
        if not raw:
            continue
        try:
            values[name] = parse(raw)
        except ValueError as expected:
            errors.append(f"{variable}={raw!r} (expected {expected}, or unset for the default)")
    if errors:
        raise ValueError("invalid qwen21-nodes setting: " + "; ".join(errors))
    return Settings(**values)


_current: Settings | None = None
_lock = threading.Lock()


def current() -> Settings:
    """The process's settings, parsed at the first call (see the module docstring)."""
    found = _current
    if found is not None:
        return found
    return _read_once()


def _read_once() -> Settings:
    global _current
    with _lock:
        if _current is None:
            _current = read()
        return _current


def reset() -> None:
    """Forget the parsed settings: the next `current()` reads the environment again (tests)."""
    global _current
    with _lock:
        _current = None


def replace(**changes) -> Settings:
    """Use `current()` with `changes` from now on, and return the settings before (benchmarks and tests that compare
    two values in one process; give the returned object to `use` to go back)."""
    before = current()
    use(dataclasses.replace(before, **changes))
    return before


def use(settings: Settings | None) -> None:
    """Use exactly `settings` from now on (None: read the environment again at the next use)."""
    global _current
    with _lock:
        _current = settings


def triton_interpreter_requested() -> bool:
    """Triton's own TRITON_INTERPRET (not a setting of ours): Triton reads it when it decorates a function, so the
    kernels read it once, at their import, to know whether CPU tensors run them through the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
