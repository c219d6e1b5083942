"""Launch configurations (tile shapes, warps, stages) of the kernels that have more than one good one, looked up
instead of tuned on the user's time.

Autotuning at run time made the user wait seconds for the first image in every new process, and again for every new
shape: Triton's autotuner compiles and times every candidate the first time a key is met. Here a kernel's configuration
for a key comes from, in order:

1. the table tuned offline for this GPU architecture, `kernels/tuned/sm_<major><minor>.json`, written by
   `benchmarks/tune_kernels.py` (sm_90's is measured); a key the table lacks takes the entry with the
   same other fields and the nearest M bucket, if there is one;
2. the kernel's rule: a safe, reasonable configuration for any card (logged once per kernel and architecture);
3. only with QWEN21_AUTOTUNE=1 (kernels/settings.py): Triton's autotuner over the kernel's candidates instead of 2,
   with its results cached on disk where this Triton can (`cache_results`), so tuning happens once per shape on a
   card with no table, not once per process.

Only the chosen configuration is compiled. A configuration that fails to compile or launch for lack of resources (a
smaller card's shared memory) is dropped for the process and the next candidate runs; the log says so. A launch keyed
by M bucket first calls the bucket gate, where the start-up layer has set one (`set_bucket_gate`): while a background
warm-up compiles a bucket's configurations, a launch of that bucket waits there instead of compiling the same kernels
a second time at once. The kernels keep no state about the warm-up themselves.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from . import settings
from ._triton import next_power_of_2, triton
from .launch import launch

log = logging.getLogger(__name__)

TABLE_DIR = Path(__file__).with_name("tuned")
M_BUCKET_MAX = 16384


def m_bucket(rows: int) -> int:
    """The power-of-two bucket a row count is tuned under: prompts and reference counts of every length share a
    handful of buckets instead of each being a new key."""
    return min(next_power_of_2(max(1, int(rows))), M_BUCKET_MAX)


@dataclass(frozen=True)
class LaunchConfig:
    meta: tuple[tuple[str, int], ...]  # the kernel's constexpr tile parameters, e.g. (("BLOCK_M", 128), ...)
    num_warps: int
    num_stages: int = 3

    @classmethod
    def of(cls, num_warps: int, num_stages: int = 3, **meta: int) -> LaunchConfig:
        return cls(tuple(sorted(meta.items())), int(num_warps), int(num_stages))

    @classmethod
    def from_json(cls, data: dict) -> LaunchConfig:
        data = dict(data)
        return cls.of(data.pop("num_warps"), data.pop("num_stages", 3), **data)

    def __post_init__(self):
        # built once: launches read them at every call (a dict built per launch costs about a microsecond)
        object.__setattr__(self, "_meta", dict(self.meta))
        object.__setattr__(self, "launch_kwargs", {**self._meta, "num_warps": self.num_warps,
                                                   "num_stages": self.num_stages})  # fmt: skip

    def meta_dict(self) -> dict[str, int]:
        """The tile parameters by name (shared: read it, do not change it)."""
        return self._meta

    def as_dict(self) -> dict:
        """The tile parameters with num_warps and num_stages, as a table entry writes them (a copy)."""
        return dict(self.launch_kwargs)

    def triton_config(self):
        return triton.Config(dict(self.meta), num_warps=self.num_warps, num_stages=self.num_stages)

    def __str__(self) -> str:
        tiles = ", ".join(f"{k}={v}" for k, v in self.meta)
        return f"{tiles}, warps={self.num_warps}, stages={self.num_stages}"


def key_text(key: dict) -> str:
    """A key as the tables write it: 'NAME=value,...' in the kernel's key order (bools as 0/1)."""
    return ",".join(f"{name}={int(value)}" for name, value in key.items())


_architectures: dict[int | None, str] = {}


def architecture(device: torch.device) -> str:
    """ "sm_<major><minor>" of a CUDA device (kept per device: asked at every launch)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _architectures:
        major, minor = torch.cuda.get_device_capability(index)
        _architectures[index] = f"sm_{major}{minor}"
    return _architectures[index]


_forced = threading.local()


@contextlib.contextmanager
def forced_bucket(bucket: int):
    """In this thread, launch every kernel keyed by M_BUCKET with `bucket`'s configuration whatever its rows: kernel
    warm-ups compile each configuration a bucket will use with a few rows of dummy input (dit/kernel_warmup.py)."""
    saved = getattr(_forced, "bucket", None)
    _forced.bucket = int(bucket)
    try:
        yield
    finally:
        _forced.bucket = saved


_bucket_gate: Callable[[int], None] | None = None


def set_bucket_gate(gate: Callable[[int], None] | None) -> None:
    """The function a launch keyed by M bucket calls with its bucket before it launches (outside `forced_bucket`), or
    None. The start-up layer sets one while a background warm-up compiles some buckets and removes it once they are
    done (qwen21_core/startup/model_warmup.py), so a launch then costs one check; what is pending, and how a wait
    ends, is the gate's business."""
    global _bucket_gate
    _bucket_gate = gate


def all_buckets() -> list[int]:
    """Every M bucket from 16 rows (the smallest a tensor-core tile takes) to M_BUCKET_MAX."""
    return [2**i for i in range(4, M_BUCKET_MAX.bit_length())]


_tables: dict[str, dict | None] = {}
_tables_lock = threading.Lock()


def tuned_table(arch: str) -> dict | None:
    """The tuned table of `arch` ({kernel: {key text: config json}}), or None where none was written."""
    with _tables_lock:
        if arch not in _tables:
            path = TABLE_DIR / f"{arch}.json"
            table = None
            if path.is_file():
                try:
                    table = json.loads(path.read_text())["kernels"]
                except (OSError, ValueError, KeyError) as error:
                    log.warning("launch configs: %s is unreadable (%s); using the kernels' rules", path, error)
            _tables[arch] = table
        return _tables[arch]


def autotune_requested() -> bool:
    return settings.current().autotune


class TunedKernel:
    """One kernel's configurations: its key, its rule, its candidates, and what failed on which architecture.

    name:       the kernel's name in the tables;
    key_names:  the launch arguments that select a configuration, in table order (one of them may be "M_BUCKET");
    rule:       key -> a configuration that is safe on any card this kernel runs on;
    candidates: key -> every configuration worth trying (the tuner's and the autotuner's search space; the rule's
                choice need not be among them).
    """

    def __init__(self, name: str, key_names: Sequence[str], rule: Callable[[dict], LaunchConfig],
                 candidates: Callable[[dict], list[LaunchConfig]]):  # fmt: skip
        self.name = name
        self.key_names = tuple(key_names)
        self.rule = rule
        self.candidates = candidates
        self._failed: set[tuple[str, LaunchConfig]] = set()
        self._logged: set[tuple[str, str]] = set()
        self._autotuners: dict = {}
        self._orders: dict[tuple, list[LaunchConfig]] = {}  # (arch, *key values) -> order(arch, key)

    # ---- choosing -----------------------------------------------------------------------------------------

    def lookup(self, arch: str, key: dict) -> tuple[LaunchConfig, str]:
        """(configuration, where it came from: "table", "table, nearest M bucket" or "rule") for `key`."""
        entries = (tuned_table(arch) or {}).get(self.name, {})
        found = entries.get(key_text(key))
        if found is not None:
            return LaunchConfig.from_json(found), "table"
        nearest = self._nearest_bucket(entries, key)
        if nearest is not None:
            return nearest, "table, nearest M bucket"
        return self.rule(key), "rule"

    def _nearest_bucket(self, entries: dict, key: dict) -> LaunchConfig | None:
        """The table's entry for `key` with the nearest M bucket (same other fields), if any."""
        if "M_BUCKET" not in key or not entries:
            return None
        wanted = key["M_BUCKET"].bit_length()
        buckets = [2**i for i in range(M_BUCKET_MAX.bit_length())]
        for bucket in sorted(buckets, key=lambda b: (abs(b.bit_length() - wanted), b)):
            found = entries.get(key_text({**key, "M_BUCKET": bucket}))
            if found is not None:
                return LaunchConfig.from_json(found)
        return None

    def order(self, arch: str, key: dict) -> list[LaunchConfig]:
        """The configurations to try for `key`, best first, without those that failed on this architecture."""
        chosen, source = self.lookup(arch, key)
        if source != "table":
            self._log_once(arch, source, key, chosen)
        ordered = [chosen, self.rule(key), *self.candidates(key)]
        seen, result = set(), []
        for config in ordered:
            if config not in seen and (arch, config) not in self._failed:
                seen.add(config)
                result.append(config)
        return result

    def _log_once(self, arch: str, source: str, key: dict, config: LaunchConfig) -> None:
        tag = (arch, source if source == "rule" else key_text(key))
        if tag in self._logged:
            return
        self._logged.add(tag)
        if source == "rule":
            has_table = tuned_table(arch) is not None
            why = f"the {arch} table has no entry for it" if has_table else f"no tuned table for {arch}"
            log.info("%s: launch configuration from its rule (%s; e.g. %s -> %s). benchmarks/tune_kernels.py "
                     "writes a table for this card.", self.name, why, key_text(key), config)  # fmt: skip
        else:
            log.info("%s: %s not in the %s table; using the nearest tuned M bucket (%s)", self.name, key_text(key),
                     arch, config)  # fmt: skip

    # ---- launching -------------------------------------------------------------------------------------------

    def launch(self, fn, grid: Callable[[LaunchConfig], tuple], args: Sequence, constexprs: dict, key: dict,
               device: torch.device) -> LaunchConfig | None:  # fmt: skip
        """Launch `fn` with the configuration for `key` (see the module docstring); returns the one that ran (None
        when the autotuner chose).

        grid(config) -> the launch grid; args: the positional arguments; constexprs: the kernel's other compile-time
        arguments (those not in the configuration). Raises the last error when every candidate failed.
        """
        forced = getattr(_forced, "bucket", None)
        gate = _bucket_gate
        if forced is not None and "M_BUCKET" in key:
            key = {**key, "M_BUCKET": forced}
        elif gate is not None and "M_BUCKET" in key:  # None (one check) once no warm-up is compiling
            gate(key["M_BUCKET"])
        if autotune_requested():
            return self._autotuned(fn, grid, args, constexprs, key)
        arch = architecture(device)
        cached = (arch, *key.values())  # the hot path: one tuple and one dict lookup per launch
        ordered = self._orders.get(cached)
        if ordered is None:
            ordered = self._orders[cached] = self.order(arch, key)
        error = None
        for config in ordered:
            try:
                launch(fn, grid(config), *args, **constexprs, **config.launch_kwargs)
                return config
            except Exception as failure:  # noqa: BLE001 - compile or resource failure: try the next candidate
                if not _is_resource_or_compile_error(failure):
                    raise
                error = failure
                self._failed.add((arch, config))
                self._orders.clear()
                log.warning("%s: launch configuration %s failed on %s (%s); trying the next", self.name, config, arch,
                            str(failure).splitlines()[0] if str(failure) else type(failure).__name__)  # fmt: skip
        raise RuntimeError(f"{self.name}: no launch configuration compiles on {arch}") from error

    def _autotuned(self, fn, grid, args, constexprs, key) -> None:
        candidates = tuple(self.candidates(key))
        tuner = self._autotuners.get((fn, candidates))
        if tuner is None:
            disk_cache = "cache_results" in inspect.signature(triton.autotune).parameters  # Triton 3.2 and newer
            options = {"cache_results": True} if disk_cache else {}
            tuner = triton.autotune([c.triton_config() for c in candidates], key=list(self.key_names), **options)(fn)
            self._autotuners[(fn, candidates)] = tuner
        meta_names = {name for config in candidates for name, _ in config.meta}

        def tuned_grid(meta):
            chosen = LaunchConfig.of(meta["num_warps"], meta.get("num_stages", 3),
                                     **{k: v for k, v in meta.items() if k in meta_names})  # fmt: skip
            return grid(chosen)

        tuner[tuned_grid](*args, **constexprs)
        return None


def _is_resource_or_compile_error(error: Exception) -> bool:
    """Failures that one configuration may hit and another not: Triton's compile errors and out-of-resources."""
    names = {type(error).__name__} | {cls.__name__ for cls in type(error).__mro__}
    known = {"OutOfResources", "CompilationError", "CompileTimeAssertionFailure", "PTXASError", "CalledProcessError"}
    return bool(names & known) or "out of resource" in str(error).lower()
