"""The command channel between rank 0 and a worker: an authenticated local connection (multiprocessing.connection)
carrying small pickled messages; tensors go over the process group, except the few a job starts with.

Messages are tuples, the first item the message's kind. Rank 0 -> worker: load, join, job, step, end, release,
fault, shutdown, abort. Worker -> rank 0: hello, ready, joined, done, released, error.
"""

from __future__ import annotations

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


def send(connection: Connection, *message) -> None:
    connection.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(connection: Connection) -> tuple:
    return pickle.loads(connection.recv_bytes())  # noqa: S301 - our own authenticated process, not a file


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
    return [sys.executable, "-c", BOOTSTRAP, package_name, package_folder]
