"""The command channel between rank 0 and a worker: an authenticated local connection (multiprocessing.connection)
carrying small pickled messages; tensors go over the process group, except the few a job starts with.

Only the pack's own processes hold the connection's key, and a message is read back with an unpickler that builds
nothing but containers, torch's tensors, dtypes and devices, the pack's own classes, and the functions of modules
rank 0 names when it starts a worker (a FunctionRecipe's, `TRUSTED_MODULES_ENV`): anything else in a message is
refused instead of imported (the pack never unpickles a file; this keeps the channel from being a way around that).

Messages are tuples, the first item the message's kind. Rank 0 -> worker: load, join, job, step, end, release,
fault, shutdown, abort. Worker -> rank 0: hello, ready, joined, done, released, error.
"""

from __future__ import annotations

import io
import pickle
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

# How a worker process starts: the package is registered under rank 0's name for it (a ComfyUI custom-node folder
# has a path-made name) WITHOUT running its top-level __init__ (which imports the ComfyUI nodes), then the worker
# module runs. argv: package name, package folder.
BOOTSTRAP = (
    "import importlib, sys, types; name, folder = sys.argv[1], sys.argv[2]; package = types.ModuleType(name); "
    "package.__path__ = [folder]; package.__package__ = name; sys.modules[name] = package; "
    "importlib.import_module(name + '.qwen21_core.parallel.worker').main()"
)


TRUSTED_MODULES_ENV = "QWEN21_PARALLEL_MODULES"  # comma-separated modules beyond the pack a message may name
PACKAGE_ROOT = __name__.removesuffix(".qwen21_core.parallel.channel")
_BUILTINS = {"tuple", "list", "dict", "set", "frozenset", "slice", "range", "complex", "bytes", "bytearray", "str",
             "int", "float", "bool"}  # fmt: skip
_ROOTS = ("torch", "collections", "pathlib")
_trusted: frozenset[str] = frozenset()  # TRUSTED_MODULES_ENV's modules, given by the worker's start (trust_modules)


def send(connection: Connection, *message) -> None:
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(connection: Connection) -> tuple:
    return _MessageUnpickler(io.BytesIO(connection.recv_bytes())).load()


def trusted_modules(*objects) -> str:
    """The value of TRUSTED_MODULES_ENV for messages carrying `objects`' functions (a FunctionRecipe's)."""
    names = {getattr(getattr(o, "function", None), "__module__", None) for o in objects}
    return ",".join(sorted(name for name in names if name and not _allowed_module(name, ())))


def trust_modules(value: str) -> None:
    """Let messages name these modules too (TRUSTED_MODULES_ENV's comma-separated value, read by worker.py at its
    start)."""
    global _trusted
    _trusted = frozenset(m for m in value.split(",") if m)


def _allowed_module(module: str, trusted) -> bool:
    root = module.split(".")[0]
    return root in _ROOTS or module == PACKAGE_ROOT or module.startswith(PACKAGE_ROOT + ".") or module in trusted


class _MessageUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module == "builtins" and name in _BUILTINS) or _allowed_module(module, _trusted):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the parallel channel refuses {module}.{name} in a message")


@dataclass(frozen=True)
class Failure:
    """What went wrong on one rank, as text (exceptions do not travel: their classes may not unpickle there)."""

    rank: int
    device: str
    kind: str  # "out of memory", "interrupted", "process exited", "timeout" or the exception's class name
    message: str
    details: str = ""  # the worker's traceback

    @classmethod
    def from_exception(cls, rank: int, device: str, error: BaseException) -> Failure:
        return cls(rank, device, failure_kind(error), str(error).strip() or type(error).__name__,
                   "".join(traceback.format_exception(error)))  # fmt: skip

    def describe(self) -> str:
        return f"rank {self.rank} ({self.device}): {self.kind}: {self.message}"


def failure_kind(error: BaseException) -> str:
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
        return "out of memory"
    if isinstance(error, KeyboardInterrupt):
        return "interrupted"
    return type(error).__name__


def python_command(package_name: str, package_folder: str) -> list[str]:
    # -P: the worker's current folder is not an import root (a queue.py there would run inside the worker).
    return [sys.executable, "-P", "-c", BOOTSTRAP, package_name, package_folder]
