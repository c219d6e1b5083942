"""A GGUF file's tensors as the loader reads a checkpoint's: names, shapes (torch order), dtypes and byte ranges.

The header is parsed by the `gguf` package (llama.cpp's own reader; optional: without it a GGUF is refused by name)
and checked before anything is allocated from it: the architecture is Qwen-Image's (or absent, as
stable-diffusion.cpp writes its files), every tensor's type is one we dequantise (kernels/dequantize_gguf.py), its
byte count is what its type and shape take, and its bytes lie inside the file and are its own. The data is then read
as any checkpoint's (checkpoints/files.py Checkpoint: positional reads of the byte ranges); a quantised tensor's
dtype is its GGUF type name ("Q4_K"), and it reads as uint8 rows [rows, row bytes].

Names are those of the file (ComfyUI's module names, from ComfyUI-GGUF's converter, or whatever stable-diffusion.cpp
kept): the loader finds the layout from them as for a safetensors file.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ...kernels.dequantize_gguf import BLOCKS, row_bytes

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# general.architecture values a Qwen-Image-2.1 diffusion model is written with (or none)
ARCHITECTURES = ("qwen_image21", "qwen_image")
ARCHITECTURE_KEY = "general.architecture"
GGUF_MAGIC = b"GGUF"


def read_gguf_header(path: Path, error: type[Exception]) -> tuple[dict, dict[str, str]]:
    """(name -> TensorInfo, metadata) of a GGUF file, checked (see the module docstring); `error` is the
    CheckpointError class to raise (files.py owns it)."""
    from .files import TensorInfo  # files.py imports this module: TensorInfo is read at call time

    try:
        import gguf
    except ImportError:
        raise error(f"{path}: reading GGUF files needs the `gguf` package (llama.cpp's reader): pip install "
                    "gguf") from None  # fmt: skip
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as err:  # noqa: BLE001 - a crafted or cut header fails inside the reader in many ways
        raise error(f"{path}: not a readable GGUF file (truncated or corrupt header: {type(err).__name__}: "
                    f"{str(err)[:200]})") from err  # fmt: skip
    arch = _string_field(reader, ARCHITECTURE_KEY)
    tensors = {}
    for tensor in reader.tensors:
        name = str(tensor.name)
        qtype = tensor.tensor_type.name
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if qtype not in BLOCKS:
            raise error(f"{path}: tensor {name!r} is stored as {qtype}, a GGUF type qwen21-nodes does not read "
                        f"(supported: {', '.join(BLOCKS)})")  # fmt: skip
        if f"comfy.gguf.orig_shape.{name}" in reader.fields:
            raise error(f"{path}: tensor {name!r} was reshaped when the file was written (comfy.gguf.orig_shape); "
                        "such tensors belong to other models than Qwen-Image-2.1")  # fmt: skip
        size_of_row = _row_bytes(path, name, qtype, shape, error)
        expected = size_of_row * math.prod(shape[:-1]) if shape else 0
        start, nbytes = int(tensor.data_offset), int(tensor.n_bytes)
        if nbytes != expected:
            raise error(f"{path}: tensor {name!r} claims shape {list(shape)} in {qtype} ({expected} bytes) but "
                        f"holds {nbytes} bytes: a corrupt file")  # fmt: skip
        if start < 0 or start + nbytes > size:
            raise error(f"{path}: truncated: tensor {name!r} ends at byte {start + nbytes} but the file has {size}. "
                        "The download or copy is incomplete; fetch the file again.")  # fmt: skip
        if name in tensors:
            raise error(f"{path}: tensor {name!r} is listed twice")
        tensors[name] = TensorInfo(path, FLOAT_TYPES.get(qtype, qtype), shape, start, nbytes)
    if not tensors:
        raise error(f"{path}: a GGUF file without tensors (a cut or empty file?)")
    metadata = {"format": "gguf", ARCHITECTURE_KEY: arch or ""}
    return tensors, metadata


def _row_bytes(path, name, qtype, shape, error) -> int:
    if not shape:
        raise error(f"{path}: tensor {name!r} has no dimensions")
    try:
        return row_bytes(qtype, shape[-1])
    except ValueError:
        block = BLOCKS[qtype][0]
        raise error(f"{path}: tensor {name!r} is {list(shape)} in {qtype}, whose rows are blocks of {block} values: "
                    "a corrupt file") from None  # fmt: skip


def _string_field(reader, key: str) -> str | None:
    field = reader.get_field(key)
    if field is None:
        return None
    try:
        return bytes(field.parts[field.data[-1]]).decode("utf-8", "replace")
    except (IndexError, TypeError, ValueError):
        return None


def foreign_architecture(metadata: dict[str, str]) -> str | None:
    """The architecture a GGUF file names if it is not Qwen-Image's, else None."""
    arch = metadata.get(ARCHITECTURE_KEY) or ""
    return arch if arch and arch not in ARCHITECTURES else None
