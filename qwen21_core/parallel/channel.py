"""The command channel between rank 0 and a worker: a loopback socket on which both ends first prove the pool's
32-byte key (an HMAC of the other's nonce, within HANDSHAKE_TIMEOUT_S), then a multiprocessing Connection carrying
small messages; tensors go over the process group, except the few a job starts with.

Only the pack's own processes hold the connection's key, and messages never go through pickle: wire.py writes and
reads plain data, tensors (dtype, shape, bytes), dtypes and devices, and the instances and functions of an exact
allowlist of (module, name) pairs: the pack's own message classes below, the pack's own DiT builder, and the
functions rank 0 names when it starts a worker (a FunctionRecipe's, `TRUSTED_FUNCTIONS_ENV`, "module:name" each).
Anything else in a message is refused, nothing is imported by a name a message carries (the pack never unpickles a
file; this keeps the channel from being a way around that, even for a local process that learnt the key).

Messages are tuples, the first item the message's kind. Rank 0 -> worker: load, join, job, step, end, release,
fault, shutdown, abort. Worker -> rank 0: hello, ready, joined, done, released, error.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib
import secrets
import socket
import sys
import time
import traceback
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from ..errors import stable_name
from . import wire
from .group import LOOPBACK

# How a worker process starts: the package is registered under rank 0's name for it (a ComfyUI custom-node folder
# has a path-made name) WITHOUT running its top-level __init__ (which imports the ComfyUI nodes), then the worker
# module runs. argv: package name, package folder.
BOOTSTRAP = (
    "import importlib, sys, types; name, folder = sys.argv[1], sys.argv[2]; package = types.ModuleType(name); "
    "package.__path__ = [folder]; package.__package__ = name; sys.modules[name] = package; "
    "importlib.import_module(name + '.qwen21_core.parallel.worker').main()"
)


TRUSTED_FUNCTIONS_ENV = "QWEN21_PARALLEL_FUNCTIONS"  # comma-separated "module:name" builders a message may name
# A connection must prove the key within this long: a worker answers at once, and a local process that connects
# and stays silent must not hold up the start (which otherwise waits up to the load timeout for the workers).
HANDSHAKE_TIMEOUT_S = 10.0
_NONCE = 32


@stable_name
class HandshakeError(ConnectionError):
    """A connection to the channel that did not prove the key in time."""


def listen() -> socket.socket:
    """Rank 0's listening socket on a free loopback port; accept() on it gives up after a short wait (the caller
    watches its workers between tries)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(64)
    except BaseException:
        listener.close()
        raise
    listener.settimeout(0.2)
    return listener


def accept(sock: socket.socket, authkey: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:
    """Rank 0's side of a new connection: both ends prove the key (HMAC of the other's nonce) within timeout_s in
    all, then the socket becomes the channel. HandshakeError (the socket closed) otherwise."""
    return _handshake(sock, authkey, timeout_s, rank0=True)


def connect(address: tuple[str, int], authkey: bytes, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:
    """A worker's side: connect to rank 0 and prove the key (and check that rank 0 holds it too)."""
    return _handshake(socket.create_connection(address, timeout=timeout_s), authkey, timeout_s, rank0=False)


def _handshake(sock: socket.socket, authkey: bytes, timeout_s: float, rank0: bool) -> Connection:
    deadline = time.monotonic() + timeout_s

    def proof(role: bytes, nonce: bytes) -> bytes:
        return hmac.new(authkey, role + nonce, hashlib.sha256).digest()

    try:
        mine = secrets.token_bytes(_NONCE)
        if rank0:
            sock.sendall(mine)
            answer = _receive_exactly(sock, 2 * _NONCE, deadline)
            if not hmac.compare_digest(answer[:_NONCE], proof(b"worker", mine)):
                raise HandshakeError("the peer does not hold the key")
            sock.sendall(proof(b"rank0", answer[_NONCE:]))
        else:
            theirs = _receive_exactly(sock, _NONCE, deadline)
            sock.sendall(proof(b"worker", theirs) + mine)
            if not hmac.compare_digest(_receive_exactly(sock, _NONCE, deadline), proof(b"rank0", mine)):
                raise HandshakeError("rank 0 does not hold the key")
        sock.settimeout(None)
        return Connection(sock.detach())
    except HandshakeError:
        sock.close()
        raise
    except OSError as error:  # a timeout or a reset
        sock.close()
        raise HandshakeError(f"{type(error).__name__}: {error}") from None


def _receive_exactly(sock: socket.socket, count: int, deadline: float) -> bytes:
    data = b""
    while len(data) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeError("no answer in time")
        sock.settimeout(left)
        piece = sock.recv(count - len(data))
        if not piece:
            raise HandshakeError("the peer closed the connection")
        data += piece
    return data


def send(connection: Connection, *message) -> None:
    connection.send_bytes(wire.encode(message, _allowed()))


def receive(connection: Connection) -> tuple:
    message = wire.decode(connection.recv_bytes(), _allowed())
    if not isinstance(message, tuple) or not message or not isinstance(message[0], str):
        raise wire.MessageError("a message must be a tuple starting with its kind")
    return message


def trusted_functions(*objects) -> str:
    """The value of TRUSTED_FUNCTIONS_ENV for messages carrying `objects`' functions (a FunctionRecipe's): each
    function that is not the pack's own, as "module:name"."""
    own = _own_functions()
    pairs = set()
    for item in objects:
        function = getattr(item, "function", None)
        if isinstance(function, types.FunctionType):
            pair = (function.__module__, function.__qualname__)
            if pair not in own:
                pairs.add(f"{pair[0]}:{pair[1]}")
    return ",".join(sorted(pairs))


@functools.cache
def _own_classes() -> dict[tuple[str, str], type]:
    """The pack's message classes: what a job, a recipe or a failure is made of."""
    from ..config import TransformerConfig
    from ..dit.kv_cache import KVCacheSpec
    from ..options import SampleOptions
    from ..quant.plan import WeightFormats
    from .jobs import BranchInput, JobSpec
    from .recipes import FileRecipe, FunctionRecipe

    classes = (Failure, JobSpec, BranchInput, KVCacheSpec, SampleOptions, FileRecipe, FunctionRecipe, WeightFormats,
               TransformerConfig)  # fmt: skip
    return {(cls.__module__, cls.__qualname__): cls for cls in classes}


@functools.cache
def _own_functions() -> dict[tuple[str, str], types.FunctionType]:
    from .recipes import tiny_transformer

    return {(f.__module__, f.__qualname__): f for f in (tiny_transformer,)}


class _TrustedFunctions(Mapping):
    """The pack's own builders and the exact "module:name" pairs of TRUSTED_FUNCTIONS_ENV (a module is imported
    only when a message names one of its listed functions; the name is looked up in it, never followed as a path)."""

    def __init__(self, listed: str):
        self.own = _own_functions()
        self.listed = set()
        for entry in filter(None, (part.strip() for part in listed.split(","))):
            module, _, name = entry.partition(":")
            if not module or not name.isidentifier():
                raise ValueError(f"{TRUSTED_FUNCTIONS_ENV}: {entry!r} is not module:function_name")
            self.listed.add((module, name))

    def __getitem__(self, key):
        if key in self.own:
            return self.own[key]
        if key not in self.listed:
            raise KeyError(key)
        function = vars(importlib.import_module(key[0])).get(key[1])
        if not isinstance(function, types.FunctionType):
            raise KeyError(key)
        return function

    def __iter__(self) -> Iterator:
        return iter(self.own.keys() | self.listed)

    def __len__(self) -> int:
        return len(self.own.keys() | self.listed)


_allowed_now: wire.Allowed | None = None  # the pack's own, plus what trust_functions was given


def trust_functions(listed: str) -> None:
    """Let messages name these builders too: TRUSTED_FUNCTIONS_ENV's value, which a worker's start reads (rank 0
    decodes only the workers' replies, which name none)."""
    global _allowed_now
    _allowed_now = wire.Allowed(_own_classes(), _TrustedFunctions(listed))


def _allowed() -> wire.Allowed:
    if _allowed_now is None:
        trust_functions("")
    return _allowed_now


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
