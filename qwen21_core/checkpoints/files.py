"""Safetensors (and GGUF) checkpoints: open and validate, identify what they hold, stream them into a module.

Three steps, in the order the loader uses them:

1. `Checkpoint.open(path)` reads only the JSON headers of a single `.safetensors` file, a sharded set
   (`*.safetensors.index.json`) or a folder holding either, and checks them: missing file, not a
   safetensors file (pickle, garbage), truncated download, inconsistent header. A GGUF file (its magic) is read
   the same way from its own header (gguf_files.py); its quantised tensors read as uint8 rows of blocks.
2. `identify(ckpt, component)` probes a few distinctive keys and shapes to find the layout (diffusers or
   ComfyUI, ...) of the Qwen-Image-2.1 component we expect, or to say what the file is instead
   (Qwen-Image 1.x, Wan, Flux, SD, an LLM, a LoRA, ...).
3. `build_empty(...)` constructs a module without allocating its weights, then `load_into(slots, ...)`
   copies each checkpoint tensor, renamed by a key map (key_maps.py) and dequantised if it is fp8
   (formats.py), into the tensor the module names for it. Tensors are read one at a time with plain
   file reads (no mmap: mapped pages would count against the process's memory as a second copy of the
   file); on CUDA they travel through two small pinned buffers so that disk reads overlap the copies.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...kernels.dequantize_gguf import BLOCKS as GGUF_BLOCKS
from ...kernels.dequantize_gguf import dequantize_gguf
from ..errors import stable_name
from ..paths import join_inside
from ..quant.gguf_linear import GGUFSlot
from ..quant.slots import QuantSlot, StoredQuant
from . import formats
from .gguf_files import GGUF_MAGIC, read_gguf_header

log = logging.getLogger(__name__)

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors itself refuses larger headers
_CHUNK_BYTES = 64 * 1024 * 1024  # pinned staging buffer size (two of them) for CUDA targets
# Reads larger than _READ_PIECE are split into pieces read by _READ_THREADS threads at once. From the page cache
# (a restart: the files were read before) the copy out of it is the load's bound, and more threads with smaller
# pieces copied faster than a few threads with large ones (benchmarks/bench_loader_node.py times the load); from a
# disk, more reads in flight help too.
_READ_PIECE = 4 * 1024 * 1024
_READ_THREADS = max(4, min(16, os.cpu_count() or 4))
_SHOWN = 5  # how many keys an error message lists

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
_PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")

Converter = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


@stable_name
class CheckpointError(ValueError):
    """A checkpoint file is unusable (not safetensors, truncated, inconsistent)."""


@stable_name
class WrongModelError(CheckpointError):
    """The file holds some other model than the Qwen-Image-2.1 component asked for."""


@stable_name
class CheckpointMismatchError(CheckpointError):
    """The checkpoint's tensors do not fit the module (missing / unexpected keys, shape mismatches)."""


# ---------------------------------------------------------------------------------------------------------
# 1. Opening and validating
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives. dtype is a string for safetensors dtypes torch has no name for (F8_E8M0, F4)."""

    file: Path
    dtype: torch.dtype | str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in `file`
    nbytes: int


class Checkpoint:
    """The tensors of one checkpoint (one file or a sharded set); data is read on demand."""

    def __init__(self, path: Path, tensors: dict[str, TensorInfo], metadata: dict[str, str]):
        self.path = path
        self.tensors = tensors
        self.metadata = metadata
        self._files: dict[Path, object] = {}  # buffered handles for sequential reads
        self._fds: dict[Path, int] = {}  # raw descriptors for parallel positional reads
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def open(cls, path: str | os.PathLike, header_limit: int | None = None) -> Checkpoint:
        """Open a `.safetensors` file, a `*.safetensors.index.json`, or a folder holding one of them. header_limit:
        the largest header (bytes) a file may have (safetensors' own 100 MiB by default; LoRAs ask far less)."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"checkpoint not found: {path} (check the path or the file name)")
        if path.is_dir():
            path = _pick_in_folder(path)
        if path.name.endswith(".index.json"):
            return cls._open_sharded(path)
        if _is_gguf(path):
            tensors, metadata = read_gguf_header(path, CheckpointError)
            _refuse_overlaps(path, tensors)
            return cls(path, tensors, metadata)
        tensors, metadata = _read_header(path, header_limit or _HEADER_LIMIT)
        return cls(path, tensors, metadata)

    @property
    def is_gguf(self) -> bool:
        return self.metadata.get("format") == "gguf" and Path(self.path).suffix != ".json"

    @classmethod
    def _open_sharded(cls, index_path: Path) -> Checkpoint:
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index_path}: not a safetensors index (needs a 'weight_map'): {err}") from err
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: its weight_map must map tensor names to shard file names")
        tensors, metadata, shards = {}, {}, {}
        for shard_name in sorted(set(weight_map.values())):
            try:  # an index names files beside it, never elsewhere (a shard "/etc/passwd" would be opened)
                shard = shards[shard_name] = Path(join_inside(index_path.parent, shard_name, "shard"))
            except ValueError as err:
                raise CheckpointError(f"{index_path}: {err}") from None
            if not shard.exists():
                raise FileNotFoundError(f"{index_path}: shard {shard_name} is missing (incomplete download?)")
            shard_tensors, shard_metadata = _read_header(shard)
            tensors.update(shard_tensors)
            metadata = metadata or shard_metadata
        misplaced = [key for key, shard in weight_map.items() if tensors.get(key, None) is None]
        misplaced += [key for key, shard in weight_map.items() if key in tensors and tensors[key].file != shards[shard]]
        if misplaced:
            raise CheckpointError(
                f"{index_path}: the index lists {len(misplaced)} tensors that are not in the shard it names, "
                f"e.g. {misplaced[:_SHOWN]}"
            )
        return cls(index_path, tensors, metadata)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].shape

    def dtype(self, key: str) -> torch.dtype | str:
        return self.tensors[key].dtype

    def read(self, key: str) -> torch.Tensor:
        """One tensor, read into fresh CPU memory."""
        info = self.tensors[key]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        self.read_bytes(key, 0, buf)
        return _as_tensor(buf, info)

    def read_bytes(self, key: str, offset: int, out: torch.Tensor) -> None:
        """Fill the CPU uint8 tensor `out` with bytes [offset, offset + out.numel()) of a tensor's data.

        Large reads are split into pieces read by a few threads at once (positional reads release the GIL):
        more requests in flight for the disk, more cores copying out of the page cache.
        """
        info = self.tensors[key]
        view = memoryview(out.numpy()).cast("B")
        position = info.start + offset
        if not hasattr(os, "preadv") or len(view) <= _READ_PIECE:  # no positional reads on Windows
            self._read_sequential(info.file, position, view, key)
            return
        fd = self._fd(info.file)
        pieces = range(0, len(view), _READ_PIECE)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="qwen21-read")
        reads = [self._pool.submit(_pread_into, fd, view[i : i + _READ_PIECE], position + i, key) for i in pieces]
        for read in reads:
            read.result()

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        return self._fds[file]

    def _read_sequential(self, file: Path, position: int, view: memoryview, key: str) -> None:
        handle = self._files.get(file)
        if handle is None:
            handle = self._files[file] = open(file, "rb", buffering=0)  # noqa: SIM115 - closed in close()
        done = 0
        while done < len(view):  # a raw read may return less than asked (2 GiB cap on Linux)
            handle.seek(position + done)
            count = handle.readinto(view[done:])
            if not count:
                raise CheckpointError(f"{file}: file ended while reading {key} (truncated while in use?)")
            done += count

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        for handle in self._files.values():
            handle.close()
        for fd in self._fds.values():
            os.close(fd)
        self._files.clear()
        self._fds.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pick_in_folder(folder: Path) -> Path:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    files = sorted(folder.glob("*.safetensors"))
    if len(indexes) == 1:
        return indexes[0]
    if len(indexes) > 1:
        raise CheckpointError(f"{folder}: several safetensors indexes {[p.name for p in indexes]}; pass one of them")
    if len(files) == 1:
        return files[0]
    if len(files) > 1:
        raise CheckpointError(
            f"{folder}: {len(files)} .safetensors files and no *.safetensors.index.json to say how they belong "
            f"together ({[p.name for p in files[:_SHOWN]]}); pass one file"
        )
    others = sorted(p.name for p in folder.iterdir() if p.suffix in (*_PICKLE_SUFFIXES, ".gguf"))
    hint = f" It has {others}: only .safetensors is supported (pickle files are never opened)." if others else ""
    raise CheckpointError(f"{folder}: no .safetensors file in this folder.{hint}")


def _read_header(path: Path, limit: int = _HEADER_LIMIT) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (only {size} bytes long)")
        header_len = int.from_bytes(head, "little")
        if _HEADER_LIMIT >= header_len > limit and 8 + header_len <= size:
            raise CheckpointError(f"{path}: its header is {header_len / 2**20:.1f} MiB, more than the "
                                  f"{limit / 2**20:g} MiB this kind of file needs (a crafted file?)")  # fmt: skip
        if header_len > _HEADER_LIMIT or 8 + header_len > size:
            raise CheckpointError(f"{path}: {_not_safetensors_reason(path, head)}")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}: {_not_safetensors_reason(path, head)} ({err})") from err

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt header: __metadata__ must map names to strings, got {metadata!r:.200}")
    data_start, data_size = 8 + header_len, size - 8 - header_len
    tensors = {key: _tensor_info(path, key, entry, data_start) for key, entry in header.items()}
    data_end, last = max(((info.start - data_start + info.nbytes, key) for key, info in tensors.items()),
                         default=(0, None))  # fmt: skip
    if data_end > data_size:
        raise CheckpointError(
            f"{path}: truncated: its header describes {data_end} bytes of tensor data (tensor {last!r} ends there) "
            f"but only {data_size} are present ({data_end - data_size} missing). The download or copy is "
            "incomplete; fetch the file again."
        )
    _refuse_overlaps(path, tensors)
    return tensors, metadata


def _refuse_overlaps(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """Tensors must not share bytes (as the safetensors library requires): a file whose tensors all point at one
    region would otherwise be read, and held, once per tensor: many times its size in memory."""
    spans = sorted((info.start, info.start + info.nbytes, key) for key, info in tensors.items() if info.nbytes)
    for (_start, end, before), (start, _end, key) in itertools.pairwise(spans):
        if start < end:
            raise CheckpointError(
                f"{path}: corrupt header: tensors {before!r} and {key!r} share bytes of the file (their data_offsets "
                "overlap); a safetensors file stores each tensor in bytes of its own. Fetch the file again."
            )


def _tensor_info(path: Path, key: str, entry, data_start: int) -> TensorInfo:
    """One header entry, checked: a dtype name, a shape of integers >= 0, two integer offsets in order (the caller
    checks that they lie within the file), and (for dtypes torch knows) as many bytes as dtype x shape. A file is
    downloaded from strangers: a negative offset or a float must not reach a read or an allocation."""

    def corrupt(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: corrupt safetensors header entry for tensor {key!r}: {what}")

    if not isinstance(entry, dict):
        raise corrupt(f"the entry is {entry!r:.100}, not an object with dtype, shape and data_offsets")
    dtype_name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype_name, str):
        raise corrupt(f"dtype {dtype_name!r:.100} is not a name")
    if not isinstance(shape, list) or not all(_is_size(n) for n in shape):
        raise corrupt(f"shape {shape!r:.100} is not a list of integers >= 0")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_size(n) for n in offsets):
        raise corrupt(f"data_offsets {offsets!r:.100} is not two integers >= 0")
    begin, end = offsets
    if begin > end:
        raise corrupt(f"data_offsets {offsets} end before they begin")
    dtype = _DTYPES.get(dtype_name, dtype_name)
    if isinstance(dtype, torch.dtype) and end - begin != _numel(shape) * dtype.itemsize:
        raise CheckpointError(
            f"{path}: corrupt header: {key} claims shape {list(shape)} {dtype_name} but {end - begin} bytes"
        )
    return TensorInfo(path, dtype, tuple(shape), data_start + begin, end - begin)


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _not_safetensors_reason(path: Path, head: bytes) -> str:
    if head.startswith(b"PK\x03\x04") or head[:1] == b"\x80" or path.suffix in _PICKLE_SUFFIXES:
        return "a PyTorch pickle checkpoint; pickles are never opened (they can run code). Use a .safetensors file"
    return "not a safetensors file (its first 8 bytes do not give a plausible header length)"


def _numel(shape: Iterable[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _pread_into(fd: int, view: memoryview, position: int, key: str) -> None:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], position + done)
        if not count:
            raise CheckpointError(f"file ended while reading {key} (truncated while in use?)")
        done += count


def _as_tensor(raw: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    """View raw uint8 bytes (CPU or device) as the tensor they encode; a GGUF block type's as uint8 rows (one per
    row of the tensor's shape, its values in blocks)."""
    if isinstance(info.dtype, str) and info.dtype in GGUF_BLOCKS:
        return raw.view(_numel(info.shape[:-1]), -1)
    return raw.view(info.dtype).view(info.shape)


def gguf_type(info: TensorInfo) -> str | None:
    """The GGUF block type of a quantised GGUF tensor ("Q4_K"), None for any other tensor."""
    return info.dtype if isinstance(info.dtype, str) and info.dtype in GGUF_BLOCKS else None


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


# ---------------------------------------------------------------------------------------------------------
# 2. Identifying the model
# ---------------------------------------------------------------------------------------------------------

COMPONENT_NAMES = {
    "transformer": "transformer (diffusion model)",
    "vae": "VAE",
    "text_encoder": "text encoder (Qwen3-VL-8B)",
    "control": "Fun-Controlnet-Union (control and inpainting)",
}


@dataclass(frozen=True)
class Layout:
    """How a checkpoint of one component names its tensors.

    component:  "transformer", "vae", "text_encoder" or "control" (the Fun-Control branch).
    name:       "diffusers" (our module's names), "comfyui" (ComfyUI single file), "transformers" (Hugging Face
                Qwen3-VL names, which Comfy-Org's text-encoder files use too) or "comfyui-internal" (the names of
                ComfyUI's own Qwen3-VL module, e.g. a file written by ComfyUI's CLIPSave).
    prefix:     a prefix every key carries and the key map strips (DiT files: "model.diffusion_model.").
    """

    component: str
    name: str
    prefix: str = ""


def identify(ckpt: Checkpoint, component: str) -> Layout:
    """The layout of `ckpt` if it is the Qwen-Image-2.1 `component`; WrongModelError saying what it is otherwise."""
    if component not in COMPONENT_NAMES:
        raise ValueError(f"component must be one of {sorted(COMPONENT_NAMES)}, got {component!r}")
    layout = _probe(ckpt, component)
    if layout is not None:
        return layout
    found = describe(ckpt)
    wanted = f"the Qwen-Image-2.1 {COMPONENT_NAMES[component]}"
    if found:
        raise WrongModelError(f"{ckpt.path}: expected {wanted}, but this file is {found}.")
    raise WrongModelError(
        f"{ckpt.path}: expected {wanted}, but none of its {len(ckpt)} keys match any known layout "
        f"(first keys: {ckpt.keys()[:_SHOWN]})."
    )


def _probe(ckpt: Checkpoint, component: str) -> Layout | None:
    if component == "transformer":
        norm = _find(ckpt, "txt_in.text_norm.weight")
        if norm is None:
            return None
        prefix = norm[: -len("txt_in.text_norm.weight")]
        fused = _find(ckpt, "img_mlp.gate_up.weight") is not None
        return Layout("transformer", "comfyui" if fused else "diffusers", prefix)
    if component == "vae":
        conv_in = ckpt.tensors.get("encoder.conv_in.weight")
        if conv_in is not None and len(conv_in.shape) == 4 and "decoder.norm_out.gamma" in ckpt:
            return Layout("vae", "diffusers")
        head = ckpt.tensors.get("decoder.head.2.weight")
        wan22 = "decoder.upsamples.0.upsamples.0.residual.2.weight" in ckpt
        if wan22 and head is not None and len(head.shape) == 5 and head.shape[2] == 1:
            return Layout("vae", "comfyui")
        return None
    if component == "control":
        # the 2.1 branch's blocks are single-stream: no img_mod/txt_mod (Qwen-Image 1.x's Fun ControlNets have them)
        img_in = _find(ckpt, "control_img_in.weight")
        if img_in is None or not _find(ckpt, "control_blocks.0.attn.norm_q.weight") or _find(ckpt, "img_mod.1.weight"):
            return None
        prefix = img_in[: -len("control_img_in.weight")]
        fused = _find(ckpt, "img_mlp.gate_up.weight") is not None
        return Layout("control", "comfyui" if fused else "diffusers", prefix)
    if component != "text_encoder":
        return None
    if "model.visual.deepstack_merger_list.0.norm.weight" in ckpt and _find(ckpt, "language_model.norm.weight"):
        return Layout("text_encoder", "transformers")
    if "visual.deepstack_merger_list.0.norm.weight" in ckpt and "model.norm.weight" in ckpt:
        return Layout("text_encoder", "comfyui-internal")
    return None


def describe(ckpt: Checkpoint) -> str | None:
    """A few words naming the model in `ckpt`, from distinctive keys and shapes; None if unknown."""
    for check in (_describe_ours, _describe_foreign_dit, _describe_foreign_vae, _describe_foreign_text):
        found = check(ckpt)
        if found:
            return found
    return None


def _describe_ours(ckpt: Checkpoint) -> str | None:
    for component, name in COMPONENT_NAMES.items():
        if _probe(ckpt, component) is not None:
            return f"the Qwen-Image-2.1 {name}; load it as the {component.replace('_', ' ')}"
    return None


def _describe_foreign_dit(ckpt: Checkpoint) -> str | None:
    if any("lora_A" in k or "lora_down" in k or "lora_B" in k for k in ckpt.tensors):
        return "a LoRA (low-rank adapter), not a full model"
    if _find(ckpt, "control_img_in.weight") and _find(ckpt, "img_mod.1.weight"):
        return "a Fun ControlNet for Qwen-Image 1.x (double-stream blocks); Qwen-Image-2.1 needs its own"
    if _find(ckpt, "controlnet_x_embedder.weight") or _find(ckpt, "controlnet_blocks.0.weight"):
        return "a ControlNet for Qwen-Image 1.x or Flux (InstantX / diffusers layout), not Qwen-Image-2.1's Fun-Control"
    if _find(ckpt, "control_layers.0.after_proj.weight") or _find(ckpt, "control_noise_refiner.0.attention.qkv.weight"):
        return "a Fun ControlNet for Z-Image, not Qwen-Image-2.1's"
    img_in = _find(ckpt, "img_in.weight")
    if _find(ckpt, "txt_norm.weight") and img_in:
        return (
            f"a Qwen-Image 1.x (or Qwen-Image-Edit) transformer (txt_norm/img_mod keys, img_in "
            f"{list(ckpt.shape(img_in))}); Qwen-Image-2.1 is a different model"
        )
    patch = _find(ckpt, "patch_embedding.weight")
    if patch and _find(ckpt, "blocks.0.self_attn.q.weight"):
        return f"a Wan 2.x video transformer (patch_embedding {list(ckpt.shape(patch))})"
    if _find(ckpt, "double_blocks.0.img_attn.qkv.weight"):
        flux2 = _find(ckpt, "double_stream_modulation_img.lin.weight")
        return "a Flux.2 transformer" if flux2 else "a Flux transformer"
    if _find(ckpt, "single_transformer_blocks.0.attn.to_q.weight") and _find(ckpt, "x_embedder.weight"):
        return "a Flux transformer in diffusers layout"
    if _find(ckpt, "joint_blocks.0.context_block.attn.qkv.weight"):
        return "a Stable Diffusion 3 transformer"
    if _find(ckpt, "input_blocks.0.0.weight"):
        full = any(k.startswith(("first_stage_model.", "cond_stage_model.", "conditioner.")) for k in ckpt.tensors)
        return "a full Stable Diffusion checkpoint (UNet + VAE + CLIP)" if full else "a Stable Diffusion UNet"
    if "conv_in.weight" in ckpt and "time_embedding.linear_1.weight" in ckpt:
        return "a Stable Diffusion UNet in diffusers layout"
    return None


def _describe_foreign_vae(ckpt: Checkpoint) -> str | None:
    if "decoder.middle.0.residual.0.gamma" in ckpt:
        if "decoder.upsamples.0.upsamples.0.residual.2.weight" in ckpt:
            z_dim = ckpt.shape("conv2.weight")[0] if "conv2.weight" in ckpt else "?"
            return f"a Wan 2.2 video VAE (z_dim {z_dim}, 3-frame temporal kernels)"
        z_dim = ckpt.shape("conv2.weight")[0] if "conv2.weight" in ckpt else "?"
        return f"a Wan 2.1 VAE (z_dim {z_dim}), the VAE of Wan 2.1 and of Qwen-Image 1.x"
    conv_in = ckpt.tensors.get("encoder.conv_in.weight")
    if conv_in is not None and len(conv_in.shape) == 5:
        z_dim = ckpt.shape("post_quant_conv.weight")[0] if "post_quant_conv.weight" in ckpt else "?"
        return f"a Wan / Qwen-Image 1.x video VAE in diffusers layout (z_dim {z_dim})"
    dec_in = ckpt.tensors.get("decoder.conv_in.weight")
    if dec_in is not None and len(dec_in.shape) == 4:
        channels = dec_in.shape[1]
        family = {4: "SD 1.x/2.x/SDXL", 16: "SD3/Flux", 32: "Flux.2"}.get(channels, "an image")
        return f"a {family} VAE ({channels} latent channels), not the 64-channel RGBA Qwen-Image-2.1 VAE"
    return None


def _describe_foreign_text(ckpt: Checkpoint) -> str | None:
    if _find(ckpt, "linear_attn.A_log"):
        return "a Qwen3.5 language model, not Qwen3-VL-8B"
    if _find(ckpt, "layers.0.self_attn.k_proj.bias"):
        return "a Qwen2.5(-VL) language model (the Qwen-Image 1.x text encoder), not Qwen3-VL-8B"
    if "encoder.block.0.layer.0.SelfAttention.k.weight" in ckpt:
        return "a T5 text encoder"
    if _find(ckpt, "text_model.encoder.layers.0.mlp.fc1.weight"):
        return "a CLIP text encoder"
    q_norm = _find(ckpt, "layers.0.self_attn.q_norm.weight")
    if q_norm and not _find(ckpt, "deepstack_merger_list.0.norm.weight"):
        return "a text-only Qwen3 language model (no vision tower); Qwen-Image-2.1 needs Qwen3-VL-8B"
    q_proj = _find(ckpt, "layers.0.self_attn.q_proj.weight")
    if q_proj:
        return f"a language model (q_proj {list(ckpt.shape(q_proj))}), not Qwen3-VL-8B"
    return None


def _find(ckpt: Checkpoint, suffix: str) -> str | None:
    """The first key equal to `suffix` or ending in '.' + suffix."""
    if suffix in ckpt.tensors:
        return suffix
    dotted = "." + suffix
    return next((k for k in ckpt.tensors if k.endswith(dotted)), None)


# ---------------------------------------------------------------------------------------------------------
# 3. Building modules and streaming tensors into them
# ---------------------------------------------------------------------------------------------------------


@contextmanager
def _parameters_on_meta():
    """Parameters registered inside this block live on the meta device; buffers stay real.

    Modules then cost no memory and no initialisation time, while buffers their __init__ computes (rotary
    frequencies, ...) keep their values, which `Module.to_empty` would wipe.
    """

    def to_meta(module, name, param):
        if param is None or param.device.type == "meta":
            return None
        return nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    handle = nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def build_empty(factory: Callable[[], nn.Module], device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """`factory()` with uninitialised parameters of `dtype` on `device`, ready for `load_into`.

    Floating-point parameters get `dtype`, others keep theirs (and so do those a module lists in `param_dtypes`,
    e.g. a quantised layer's fp8 weight and fp32 scale); tied parameters stay tied; buffers keep the
    values and dtypes __init__ gave them and move to `device`. The module is returned in eval mode without
    gradients.
    """
    with _parameters_on_meta():
        module = factory()
    device = torch.device(device)
    new_params: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is None:
                continue
            if id(param) not in new_params:
                # quantised layers name the dtypes of their parameters (an fp8 weight, an fp32 scale)
                kept = getattr(sub, "param_dtypes", {}).get(name)
                param_dtype = kept or (dtype if param.is_floating_point() else param.dtype)
                storage = torch.empty(param.shape, dtype=param_dtype, device=device)
                new_params[id(param)] = nn.Parameter(storage, requires_grad=False)
            sub._parameters[name] = new_params[id(param)]
        for name, buffer in sub._buffers.items():
            if buffer is not None:
                sub._buffers[name] = buffer.to(device)
    return module.eval()


def module_slots(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """Checkpoint key -> tensor to fill: `module.checkpoint_slots()` if it has one, else its state dict."""
    if hasattr(module, "checkpoint_slots"):
        return module.checkpoint_slots()
    return dict(module.state_dict(keep_vars=True))


def converted_shapes(
    ckpt: Checkpoint, convert: Converter, quant: formats.QuantScheme
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Converted (diffusers) name -> (checkpoint key it comes from, shape), without reading any data.

    The converter runs on meta tensors, so this is exactly what a load will produce.
    """
    produced, duplicates = {}, []
    for key in ckpt.keys():
        if key in quant.auxiliary:
            continue
        meta = torch.empty(ckpt.shape(key), dtype=torch.float32, device="meta")
        for name, tensor in convert(key, meta):
            if name in produced:
                duplicates.append(f"{name} (from {produced[name][0]} and {key})")
            produced[name] = (key, tuple(tensor.shape))
    if duplicates:
        raise CheckpointMismatchError(f"{ckpt.path}: {_listing('tensors produced twice', duplicates)}")
    return produced


def plan_load(
    slots: Mapping[str, torch.Tensor | None],
    ckpt: Checkpoint,
    convert: Converter,
    quant: formats.QuantScheme,
    what: str,
    produced: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
) -> list[str]:
    """Check that the checkpoint fits the slots without reading any data; return the keys to read.

    Slots whose value is None are read and dropped, so they may be absent from the checkpoint and their
    checkpoint tensors are not read at all. produced: converted_shapes' result, if the caller has it already.
    """
    produced = produced if produced is not None else converted_shapes(ckpt, convert, quant)
    missing = [name for name, slot in slots.items() if slot is not None and name not in produced]
    unexpected = [f"{name} (from {src})" if name != src else name for name, (src, _) in produced.items()
                  if name not in slots]  # fmt: skip
    mismatched = [
        f"{name}: checkpoint {list(shape)} vs model {list(slots[name].shape)}"
        for name, (_, shape) in produced.items()
        if slots.get(name) is not None and tuple(slots[name].shape) != shape
    ]
    problems = [
        _listing("missing keys", missing),
        _listing("unexpected keys", unexpected),
        _listing("shape mismatches", mismatched),
    ]
    problems = [p for p in problems if p]
    if problems:
        raise CheckpointMismatchError(f"{ckpt.path}: does not fit the {what}: " + "; ".join(problems))
    return sorted({src for name, (src, _) in produced.items() if slots.get(name) is not None})


def _listing(label: str, items: list[str]) -> str:
    if not items:
        return ""
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"{len(items)} {label} ({', '.join(items[:_SHOWN])}{more})"


@torch.no_grad()
def load_into(
    slots: Mapping[str, torch.Tensor | None],
    ckpt: Checkpoint,
    convert: Converter,
    *,
    what: str,
    quant: formats.QuantScheme | None = None,
    quiet: bool = False,
    produced: Mapping[str, tuple[str, tuple[int, ...]]] | None = None,
) -> None:
    """Copy every checkpoint tensor into its slot, converting dtype (and dequantising fp8) on the slot's device.

    `convert(key, tensor)` renames (and splits / reshapes as views) one checkpoint tensor into diffusers-named
    tensors. Peak extra memory is one tensor (plus 2 x 64 MiB pinned staging for CUDA). For callers that read a
    model back layer by layer (LoRA merges): quiet puts the summary line at debug level, and `produced` passes
    converted_shapes' result, computed once.
    """
    if quant is None:
        quant = formats.inspect(str(ckpt.path), ckpt.keys(), ckpt.dtype, ckpt.metadata, ckpt.read)
    keys = plan_load(slots, ckpt, convert, quant, what, produced)
    devices = {slot.device for slot in slots.values() if slot is not None}
    if len(devices) != 1:
        raise ValueError(f"{what}: all tensors to fill must be on one device, found {sorted(map(str, devices))}")
    device = devices.pop()
    stager = _Stager(ckpt, device)
    keys.sort(key=lambda k: (str(ckpt.tensors[k].file), ckpt.tensors[k].start))  # sequential disk reads
    start = time.perf_counter()
    for key in keys:
        _copy_one(key, slots, stager, convert, quant)
    stager.finish()
    seconds = time.perf_counter() - start
    gigabytes = sum(ckpt.tensors[k].nbytes for k in keys) / 1e9
    log.log(logging.DEBUG if quiet else logging.INFO, "%s: %.2f GB read to %s in %.2f s (%s, %d tensors)", what,
            gigabytes, device, seconds, Path(ckpt.path).name, len(keys))  # fmt: skip


def _copy_one(key, slots, stager, convert, quant) -> None:
    # A function of its own so the staged tensor is released before the next one is read.
    stored = quant.layers.get(key)
    scale = None
    if stored is not None and stored.scale_key:  # tiny; read before the weight reuses the staging buffer
        scale = stager.ckpt.read(stored.scale_key).to(stager.device, torch.float32)
    raw = stager.fetch(key)
    parts = convert(key, raw)
    # per-row scales follow their rows through the converter (the ComfyUI gate_up split, say)
    scales = [s for _, s in convert(key, scale.reshape(-1))] if scale is not None and scale.numel() > 1 else None
    info = stager.ckpt.tensors[key]
    blocks = gguf_type(info)  # a GGUF tensor's block type: its parts are uint8 rows of blocks
    for index, (name, tensor) in enumerate(parts):
        slot = slots[name]
        if slot is None:
            continue
        if isinstance(slot, GGUFSlot):  # a GGUF layer takes the file's blocks (or a float tensor) as they are
            slot.fill(tensor, blocks)
            continue
        if blocks is not None:  # into a float (or our quantised) weight: dequantised here, on the slot's device
            tensor = dequantize_gguf(tensor, blocks, info.shape[-1], torch.float32).view(slot.shape)
        part_scale = scales[index] if scales is not None else scale
        if isinstance(slot, QuantSlot):
            _fill_quantized(slot, tensor, part_scale, stored)
        elif stored is not None:
            slot.copy_(formats.dequantize(tensor, part_scale, stored.rotation))
        else:
            slot.copy_(tensor)


def _fill_quantized(slot: QuantSlot, tensor, scale, stored) -> None:
    """Stored rows go in as they are (requantised if the formats differ); float rows are quantised."""
    if stored is None:
        slot.fill(tensor)
    elif stored.fmt is None:  # fp8 e5m2: no GEMM takes it; through fp32 into the slot's format
        slot.fill(formats.dequantize(tensor, scale))
    else:
        unit = torch.ones((), device=tensor.device)
        slot.fill(tensor, StoredQuant(stored.fmt, unit if scale is None else scale))


class _Stager:
    """Brings one checkpoint tensor at a time onto the target device, in its stored dtype.

    Off CUDA the tensor is read into one reused CPU buffer (a fresh allocation per tensor would leave freed
    blocks in the allocator's cache and raise the peak), so a fetched tensor is only valid until the next
    fetch. On CUDA it is read in chunks through two pinned buffers into a new device tensor.
    """

    def __init__(self, ckpt: Checkpoint, device: torch.device):
        self.ckpt, self.device = ckpt, device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.buffers = [torch.empty(_CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.events: list[torch.cuda.Event | None] = [None, None]
            self.turn = 0
        else:
            self.buffer = torch.empty(0, dtype=torch.uint8)

    def fetch(self, key: str) -> torch.Tensor:
        info = self.ckpt.tensors[key]
        if not self.cuda:
            if self.buffer.numel() < info.nbytes:
                self.buffer = torch.empty(0, dtype=torch.uint8)  # free the old one first
                self.buffer = torch.empty(info.nbytes, dtype=torch.uint8)
            raw = self.buffer[: info.nbytes]
            self.ckpt.read_bytes(key, 0, raw)
            return _as_tensor(raw, info).to(self.device)
        out = torch.empty(info.nbytes, dtype=torch.uint8, device=self.device)
        with torch.cuda.device(self.device):
            for offset in range(0, info.nbytes, _CHUNK_BYTES):
                count = min(_CHUNK_BYTES, info.nbytes - offset)
                slot = self.turn % 2
                if self.events[slot] is not None:
                    self.events[slot].synchronize()  # the copy that last used this buffer has finished
                buffer = self.buffers[slot][:count]
                self.ckpt.read_bytes(key, offset, buffer)
                out[offset : offset + count].copy_(buffer, non_blocking=True)
                self.events[slot] = torch.cuda.Event()
                self.events[slot].record()
                self.turn += 1
        return _as_tensor(out, info)

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
