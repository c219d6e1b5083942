"""The byte format of the parallel channel's messages: plain data, tensors, and a few named classes and functions,
written and read without pickle.

A value is a tag byte and a body. Scalars: None, bool, int (signed, little-endian, up to 64 bytes), float (IEEE
double), str (UTF-8), bytes. Containers: list, tuple (torch.Size too) and dict, with a count and their items.
torch: a tensor as its dtype's name, its shape and its raw bytes (always to the CPU, rebuilt with torch.frombuffer);
a dtype by name; a device by its string. Named things: a dataclass instance as (module, class name, its init
fields) and a function as (module, name), each only if the pair is in the reader's `Allowed` table, where it maps
to the object itself.

Reading builds nothing else: no module is imported and no attribute looked up by a name read from the message (a
name with a dot in it is refused, not followed), no callable of the message's choosing runs; an allowed class's own
__init__ (and __post_init__ checks) get the fields, as from any caller. Counts and lengths are checked against the
bytes left, and nesting is limited. Anything else is a `MessageError`.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..errors import stable_name

MAX_DEPTH = 64
MAX_INT_BYTES = 64
MAX_DIMS = 32
def _plain(dtype: torch.dtype) -> bool:
    """A dtype whose tensors are plain bytes (not a quantised tensor's, which needs a quantiser to exist)."""
    return not str(dtype).removeprefix("torch.").startswith(("qint", "quint"))


_DTYPES = {str(value).removeprefix("torch."): value for value in vars(torch).values()
           if isinstance(value, torch.dtype) and _plain(value)}  # fmt: skip
MAX_DIM = 2**62  # a size torch can take
_COUNT = struct.Struct("<Q")
_FLOAT = struct.Struct("<d")


@stable_name
class MessageError(ValueError):
    """A message that is not in this format, or that names something the reader does not allow."""


@dataclass(frozen=True)
class Allowed:
    """What a message may name: (module, qualified name) -> the class or function, exactly."""

    classes: Mapping[tuple[str, str], type]
    functions: Mapping[tuple[str, str], Callable]


def encode(value, allowed: Allowed) -> bytes:
    out = bytearray()
    _write(out, value, allowed, 0)
    return bytes(out)


def decode(data: bytes, allowed: Allowed):
    reader = _Reader(memoryview(data), allowed)
    value = reader.value(0)
    if reader.at != len(data):
        raise MessageError(f"{len(data) - reader.at} bytes after the end of the message")
    return value


# ---- writing ---------------------------------------------------------------------------------------------------


def _write(out: bytearray, value, allowed: Allowed, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise MessageError(f"a message nested deeper than {MAX_DEPTH}")
    if value is None:
        out += b"N"
    elif value is True or value is False:
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        size = value.bit_length() // 8 + 1
        if size > MAX_INT_BYTES:
            raise MessageError(f"an integer of {size} bytes (at most {MAX_INT_BYTES})")
        out += b"i" + bytes([size]) + value.to_bytes(size, "little", signed=True)
    elif isinstance(value, float):
        out += b"f" + _FLOAT.pack(value)
    elif isinstance(value, str):
        _write_text(out, b"s", value)
    elif isinstance(value, (bytes, bytearray)):
        out += b"b" + _COUNT.pack(len(value)) + value
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous().resolve_conj().resolve_neg()
        out += b"X"
        _write_text(out, b"s", _dtype_name(tensor.dtype))
        _write(out, tuple(tensor.shape), allowed, depth + 1)
        data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        out += b"b" + _COUNT.pack(len(data)) + data
    elif isinstance(value, torch.dtype):
        _write_text(out, b"y", _dtype_name(value))
    elif isinstance(value, torch.device):
        _write_text(out, b"v", str(value))
    elif isinstance(value, (list, tuple, dict)):
        _write_container(out, value, allowed, depth)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        key = (cls.__module__, cls.__qualname__)
        if allowed.classes.get(key) is not cls:
            raise MessageError(f"the channel does not carry {key[0]}.{key[1]} (not in its allowlist)")
        out += b"o"
        _write_text(out, b"s", key[0])
        _write_text(out, b"s", key[1])
        fields = {field.name: getattr(value, field.name) for field in dataclasses.fields(value) if field.init}
        _write(out, fields, allowed, depth + 1)
    elif isinstance(value, types.FunctionType):
        module, name = value.__module__, value.__qualname__
        if "." in name or "<" in name:
            raise MessageError(f"function {module}.{name} is not a module's top-level function")
        out += b"g"
        _write_text(out, b"s", module)
        _write_text(out, b"s", name)
    else:
        raise MessageError(f"the channel does not carry {type(value).__module__}.{type(value).__qualname__}")


def _write_container(out: bytearray, value, allowed: Allowed, depth: int) -> None:
    if isinstance(value, dict):
        out += b"d" + _COUNT.pack(len(value))
        for key, item in value.items():
            _write(out, key, allowed, depth + 1)
            _write(out, item, allowed, depth + 1)
        return
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        raise MessageError(f"the channel does not carry named tuples ({type(value).__qualname__})")
    out += (b"l" if isinstance(value, list) else b"t") + _COUNT.pack(len(value))
    for item in value:
        _write(out, item, allowed, depth + 1)


def _write_text(out: bytearray, tag: bytes, text: str) -> None:
    data = text.encode("utf-8")
    out += tag + _COUNT.pack(len(data)) + data


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) is not dtype:
        raise MessageError(f"dtype {dtype} has no name the channel knows")
    return name


# ---- reading ---------------------------------------------------------------------------------------------------


class _Reader:
    def __init__(self, data: memoryview, allowed: Allowed):
        self.data, self.allowed, self.at = data, allowed, 0

    def take(self, count: int) -> memoryview:
        if count > len(self.data) - self.at:
            raise MessageError("the message ends early (truncated, or a count larger than its bytes)")
        piece = self.data[self.at : self.at + count]
        self.at += count
        return piece

    def count(self) -> int:
        return _COUNT.unpack(self.take(_COUNT.size))[0]

    def items(self) -> int:
        """A container's item count: each item takes at least one byte, so no count can exceed the bytes left."""
        count = self.count()
        if count > len(self.data) - self.at:
            raise MessageError(f"a container of {count} items in {len(self.data) - self.at} bytes")
        return count

    def text(self) -> str:
        try:
            return str(self.take(self.count()), "utf-8")
        except UnicodeDecodeError as error:
            raise MessageError(f"a string that is not UTF-8: {error}") from None

    def tagged_text(self, what: str) -> str:
        if bytes(self.take(1)) != b"s":
            raise MessageError(f"{what} is not a string")
        return self.text()

    def value(self, depth: int):
        if depth > MAX_DEPTH:
            raise MessageError(f"a message nested deeper than {MAX_DEPTH}")
        tag = bytes(self.take(1))
        if tag == b"N":
            return None
        if tag in (b"T", b"F"):
            return tag == b"T"
        if tag == b"i":
            size = self.take(1)[0]
            if not 1 <= size <= MAX_INT_BYTES:
                raise MessageError(f"an integer of {size} bytes")
            return int.from_bytes(self.take(size), "little", signed=True)
        if tag == b"f":
            return _FLOAT.unpack(self.take(_FLOAT.size))[0]
        if tag == b"s":
            return self.text()
        if tag == b"b":
            return bytes(self.take(self.count()))
        if tag == b"l":
            return [self.value(depth + 1) for _ in range(self.items())]
        if tag == b"t":
            return tuple(self.value(depth + 1) for _ in range(self.items()))
        if tag == b"d":
            return self.mapping(depth)
        if tag == b"X":
            return self.tensor(depth)
        if tag == b"y":
            return self.dtype(self.text())
        if tag == b"v":
            text = self.text()
            try:
                return torch.device(text)
            except (RuntimeError, ValueError):
                raise MessageError(f"{text[:40]!r} is not a device") from None
        if tag == b"o":
            return self.instance(depth)
        if tag == b"g":
            return self.function()
        raise MessageError(f"unknown tag {tag!r} at byte {self.at - 1} (not a message of this channel)")

    def mapping(self, depth: int) -> dict:
        result = {}
        for _ in range(self.items()):
            key, item = self.value(depth + 1), self.value(depth + 1)
            try:
                result[key] = item
            except TypeError:
                raise MessageError(f"a dict key of type {type(key).__name__}, which cannot be a key") from None
        return result

    def dtype(self, name: str) -> torch.dtype:
        if name not in _DTYPES:
            raise MessageError(f"unknown dtype {name[:40]!r}")
        return _DTYPES[name]

    def tensor(self, depth: int) -> torch.Tensor:
        dtype = self.dtype(self.tagged_text("a tensor's dtype"))
        shape = self.value(depth + 1)
        if (
            not isinstance(shape, tuple)
            or len(shape) > MAX_DIMS
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < MAX_DIM for n in shape)
        ):
            raise MessageError(f"a tensor shape must be a tuple of at most {MAX_DIMS} sizes >= 0, got {shape!r:.80}")
        if bytes(self.take(1)) != b"b":
            raise MessageError("a tensor's data is not bytes")
        data = self.take(self.count())
        itemsize = torch.empty((), dtype=dtype).element_size()
        if len(data) != math.prod(shape) * itemsize:
            raise MessageError(f"a {dtype} tensor of shape {list(shape)} with {len(data)} bytes of data")
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)

    def instance(self, depth: int):
        module, name = self.tagged_text("a class's module"), self.tagged_text("a class's name")
        cls = self.allowed.classes.get((module, name))
        if cls is None:
            raise MessageError(f"the channel refuses class {module[:80]}.{name[:80]} (not in its allowlist)")
        fields = self.value(depth + 1)
        names = {field.name for field in dataclasses.fields(cls) if field.init}
        if not isinstance(fields, dict) or not set(fields) <= names:
            raise MessageError(f"{name} fields must be a dict with keys among {sorted(names)}")
        try:
            return cls(**fields)
        except (TypeError, ValueError) as error:
            raise MessageError(f"{name}: {error}") from None

    def function(self):
        module, name = self.tagged_text("a function's module"), self.tagged_text("a function's name")
        function = self.allowed.functions.get((module, name))
        if function is None:
            raise MessageError(f"the channel refuses function {module[:80]}.{name[:80]} (not in its allowlist)")
        return function
