"""Where the nodes meet ComfyUI's services (memory is nodes/memory_adapter.py's).

Inside ComfyUI each service here is ComfyUI's own: model folders through `folder_paths` (standard
folders and extra_model_paths.yaml), the progress bar with live previews, the interrupt flag and
devices. Outside ComfyUI (the in-process runner, tests) each falls back to a plain implementation:
model folders under one `--models` directory, progress through logging, interrupts through a flag.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time

import torch

from ..qwen21_core.errors import stable_name
from ..qwen21_core.paths import join_inside, relative_name

log = logging.getLogger(__name__)

# Inside ComfyUI only when this process IS a ComfyUI server: it imports its model management before it loads
# custom nodes. Being able to import `comfy` is not enough: `python -m qwen21_nodes` run from the ComfyUI folder
# can, and importing comfy.model_management there would set up ComfyUI's device in a process that is not ComfyUI
# (on a machine without a GPU it raises "Found no NVIDIA driver" unless ComfyUI was started with --cpu).
comfy_mm = comfy_utils = comfy_folder_paths = None
if "comfy.model_management" in sys.modules:
    try:  # guarded: the same node classes run in ComfyUI, in the runner and in CI without ComfyUI
        import comfy.model_management as comfy_mm
        import comfy.utils as comfy_utils
        import folder_paths as comfy_folder_paths
    except ImportError:
        comfy_mm = comfy_utils = comfy_folder_paths = None

IN_COMFYUI = comfy_mm is not None

# ComfyUI model-folder keys we read (they cover the legacy `unet` and `clip` folders too).
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "diffusers", "loras", "model_patches", "controlnet")
WEIGHT_EXTENSIONS = (".safetensors", ".sft", ".gguf")  # GGUF: the diffusion model only (the loader says so)
# Outside ComfyUI, the folders of each kind beside its own (ComfyUI's folder_paths has the same pairs)
LEGACY_FOLDERS = {"diffusion_models": ("unet",), "text_encoders": ("clip",)}


@stable_name
class Interrupted(Exception):
    """The user stopped the run (outside ComfyUI; inside, ComfyUI's own exception is raised)."""


# --------------------------------------------------------------------------------------------------
# Model folders


_models_dir: str | None = None


def set_models_dir(path: str | os.PathLike | None) -> None:
    """Outside ComfyUI: the folder holding diffusion_models/, text_encoders/, vae/, diffusers/ and loras/."""
    global _models_dir
    _models_dir = None if path is None else os.path.abspath(os.fspath(path))


def model_folders(kind: str) -> list[str]:
    """Every folder searched for `kind` (one of MODEL_FOLDERS), in ComfyUI's order."""
    if kind not in MODEL_FOLDERS:
        raise ValueError(f"model folder kind must be one of {MODEL_FOLDERS}, got {kind!r}")
    if IN_COMFYUI:
        return list(comfy_folder_paths.get_folder_paths(kind))
    if not _models_dir:
        return []
    return [os.path.join(_models_dir, name) for name in (kind, *LEGACY_FOLDERS.get(kind, ()))]


def list_weight_files(kind: str) -> list[str]:
    """Weight files (safetensors, GGUF) under the `kind` folders, as paths relative to their folder (sorted). Inside
    ComfyUI its own list, plus the GGUF files it does not list (its folders know no .gguf unless ComfyUI-GGUF added
    it; adding it there would show them to core's loaders, which cannot read them)."""
    if IN_COMFYUI:
        listed = {f for f in comfy_folder_paths.get_filename_list(kind) if f.endswith(WEIGHT_EXTENSIONS)}
        return sorted(listed | _walk_for(kind, (".gguf",)))
    return sorted(_walk_for(kind, WEIGHT_EXTENSIONS))


def _walk_for(kind: str, extensions: tuple[str, ...]) -> set[str]:
    found = set()
    for root in model_folders(kind):
        for dirpath, _dirs, files in _walk(root):
            for name in files:
                if name.endswith(extensions):
                    found.add(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return found


def weight_file_path(kind: str, name: str) -> str:
    """Absolute path of the weight file `name` listed by list_weight_files(kind). The name must stay inside the
    folder (qwen21_core/paths.py: no absolute path, drive or '..'; a symlink placed inside the folder is followed):
    a name arriving through a link skips ComfyUI's list check. Inside ComfyUI its own folder_paths finds the file."""
    name = relative_name(name, f"{kind} name")
    if IN_COMFYUI:
        path = comfy_folder_paths.get_full_path(kind, name)
        if path is not None:
            return path
    else:
        for root in model_folders(kind):
            path = join_inside(root, name, f"{kind} name")
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"model file {name!r} not found in the {kind} folder(s) {model_folders(kind) or '(none configured)'}; "
        f"put it there (or add a folder through extra_model_paths.yaml) and refresh"
    )


def list_diffusers_folders() -> list[str]:
    """Sub-folders of the `diffusers` model folders that hold a model_index.json (sorted)."""
    found = set()
    for root in model_folders("diffusers"):
        if not os.path.isdir(root):
            continue
        for dirpath, dirs, files in _walk(root):
            if "model_index.json" in files:
                found.add(os.path.relpath(dirpath, root).replace(os.sep, "/"))
                dirs.clear()  # a pipeline folder's components are not pipelines themselves
    return sorted(found)


def diffusers_folder_path(name: str) -> str:
    """The folder `name` (with a model_index.json) under the diffusers model folders, kept inside them as
    weight_file_path keeps its names."""
    name = relative_name(name, "diffusers folder name")
    if IN_COMFYUI:
        index = comfy_folder_paths.get_full_path("diffusers", f"{name.rstrip('/')}/model_index.json")
        if index is not None:
            return os.path.dirname(index)
    else:
        for root in model_folders("diffusers"):
            path = join_inside(root, name, "diffusers folder name")
            if os.path.isfile(os.path.join(path, "model_index.json")):
                return path
    raise FileNotFoundError(
        f"diffusers folder {name!r} (with a model_index.json) not found under {model_folders('diffusers')}; "
        f"put the Qwen-Image-2.1 diffusers folder there and refresh"
    )


def file_identity(path: str) -> str:
    """What a file, or every file under a folder, is now: path, size and modification time. A loader node's
    IS_CHANGED returns it, so that ComfyUI's output cache (and the runner's) reads an edited file again."""
    if not os.path.isdir(path):
        try:
            stat = os.stat(path)
        except OSError as error:  # a link loop or a file gone: the load names it; this must not fail first
            return f"{os.path.abspath(path)}:unreadable:{error.errno}"
        return f"{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
    files = sorted(os.path.join(root, name) for root, _dirs, names in _walk(path) for name in names)
    return "\n".join(file_identity(file) for file in files)


def _walk(root: str):
    """os.walk following links (model folders often link to other disks), entering each real folder once: a link
    back up the tree (two made the listing, which runs on every /object_info, walk for minutes) ends at once."""
    seen = {os.path.realpath(root)}
    for dirpath, dirs, files in os.walk(root, followlinks=True):
        kept = []
        for name in sorted(dirs):
            real = os.path.realpath(os.path.join(dirpath, name))
            if real not in seen:
                seen.add(real)
                kept.append(name)
        dirs[:] = kept
        yield dirpath, dirs, files


def comfyui_root() -> str | None:
    """ComfyUI's own folder (where its bundled tokenizers live); None outside ComfyUI."""
    return os.path.dirname(os.path.abspath(comfy_folder_paths.__file__)) if IN_COMFYUI else None


# --------------------------------------------------------------------------------------------------
# Output images


_output_dir = os.path.abspath("output")


def set_output_dir(path: str | os.PathLike) -> None:
    """Outside ComfyUI: where saved images go (the runner's --output-dir)."""
    global _output_dir
    _output_dir = os.path.abspath(os.fspath(path))


def output_directory() -> str:
    return comfy_folder_paths.get_output_directory() if IN_COMFYUI else _output_dir


def metadata_disabled() -> bool:
    """ComfyUI's --disable-metadata: saved images carry no prompt or workflow."""
    if not IN_COMFYUI:
        return False
    from comfy.cli_args import args  # noqa: PLC0415 - ComfyUI's own module, only inside ComfyUI

    return bool(args.disable_metadata)


def image_files(
    filename_prefix: str, count: int, width: int, height: int, folder: str | None = None
) -> list[tuple[str, dict]]:
    """(path, the UI's entry for it) of each of `count` images to save, named as ComfyUI's Save Image names them:
    <stem>_<counter:05>_.png, %batch_num% in the stem replaced by the image's index in the batch."""
    target, stem, counter, subfolder = _image_save_path(filename_prefix, width, height, folder)
    files = []
    for number in range(count):
        name = f"{stem.replace('%batch_num%', str(number))}_{counter + number:05}_.png"
        files.append((os.path.join(target, name), {"filename": name, "subfolder": subfolder, "type": "output"}))
    return files


def _image_save_path(filename_prefix: str, width: int, height: int, folder: str | None) -> tuple[str, str, int, str]:
    """(folder, file name stem, first counter, subfolder). Inside ComfyUI its own `get_save_image_path` (its
    %width%/%date% variables and its counter); outside, the same rules: %width%, %height% and %year% to %second%
    filled in, a subfolder inside the output folder, the counter after the highest one there."""
    folder = os.path.abspath(folder or output_directory())
    if IN_COMFYUI:
        target, stem, counter, subfolder, _prefix = comfy_folder_paths.get_save_image_path(
            filename_prefix, folder, width, height
        )
        return target, stem, counter, subfolder
    now = time.localtime()
    fields = {"width": width, "height": height, "year": now.tm_year, "month": f"{now.tm_mon:02}",
              "day": f"{now.tm_mday:02}", "hour": f"{now.tm_hour:02}", "minute": f"{now.tm_min:02}",
              "second": f"{now.tm_sec:02}"}  # fmt: skip
    for name, value in fields.items():
        filename_prefix = filename_prefix.replace(f"%{name}%", str(value))
    subfolder, stem = os.path.split(os.path.normpath(filename_prefix))
    target = os.path.abspath(os.path.join(folder, subfolder))
    if os.path.commonpath([target, folder]) != folder:
        raise ValueError(f"filename_prefix {filename_prefix!r} points outside the output folder {folder}")
    os.makedirs(target, exist_ok=True)
    numbered = re.compile(re.escape(stem) + r"_(\d{5})_")
    counter = max((int(m.group(1)) for f in os.listdir(target) if (m := numbered.match(f))), default=0) + 1
    return target, stem, counter, subfolder


# --------------------------------------------------------------------------------------------------
# Devices


def torch_device() -> torch.device:
    if IN_COMFYUI:
        return comfy_mm.get_torch_device()
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def offload_device() -> torch.device:
    if IN_COMFYUI:
        return comfy_mm.unet_offload_device()
    return torch.device("cpu")


def intermediate_device() -> torch.device:
    """Where LATENT, IMAGE and MASK tensors travel between nodes (CPU in stock ComfyUI)."""
    if IN_COMFYUI:
        return comfy_mm.intermediate_device()
    return torch.device("cpu")


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


# --------------------------------------------------------------------------------------------------
# Interrupt and progress


_interrupt_requested = threading.Event()


def request_interrupt() -> None:
    """Outside ComfyUI: stop the running node at its next step or tile (ComfyUI has POST /interrupt)."""
    _interrupt_requested.set()


def check_interrupted() -> None:
    """Raise if the user asked to stop; clears the request, so the next run starts clean."""
    if IN_COMFYUI:
        comfy_mm.throw_exception_if_processing_interrupted()
        return
    if _interrupt_requested.is_set():
        _interrupt_requested.clear()
        raise Interrupted("interrupted by the user")


def previews_enabled() -> bool:
    """ComfyUI sends live previews only when started with --preview-method other than none."""
    if not IN_COMFYUI:
        return False
    try:
        from comfy.cli_args import LatentPreviewMethod, args
    except ImportError:
        return False
    return args.preview_method != LatentPreviewMethod.NoPreviews


class Progress:
    """One node's progress: ComfyUI's progress bar (with an optional preview image) or log lines.

    Every update is also an interruption point, as it is in ComfyUI.
    """

    def __init__(self, total: int, what: str):
        self.total = max(int(total), 1)
        self.what = what
        self._bar = comfy_utils.ProgressBar(self.total) if IN_COMFYUI else None

    def update(self, done: int, preview=None) -> None:
        """done: absolute count; preview: a PIL image shown on the node (ComfyUI only)."""
        check_interrupted()
        if self._bar is not None:
            payload = None if preview is None else ("JPEG", preview, _preview_max_size())
            self._bar.update_absolute(done, self.total, payload)
        else:
            log.info("%s %d/%d", self.what, done, self.total)


def _preview_max_size() -> int:
    from comfy.cli_args import args

    return getattr(args, "preview_size", 512)
