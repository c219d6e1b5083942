"""The one place where the nodes meet ComfyUI.

Inside ComfyUI each service here is ComfyUI's own: model folders through `folder_paths` (standard
folders and extra_model_paths.yaml), the progress bar with live previews, the interrupt flag, devices
and the memory manager (ModelPatcher + load_models_gpu). Outside ComfyUI (the in-process runner,
tests) each falls back to a plain implementation: model folders under one `--models` directory,
progress through logging, interrupts through a flag, and no memory manager (the pipeline's own
offload policy places the weights).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable

import torch

from ..qwen21_core.errors import stable_name
from ..qwen21_core.memory.manager import LocalMemoryManager
from ..qwen21_core.memory.planner import indexed_device
from ..qwen21_core.memory.streaming import StreamableStack
from ..qwen21_core.paths import join_inside, relative_name

log = logging.getLogger(__name__)

# Inside ComfyUI only when this process IS a ComfyUI server: it imports its model management before it loads
# custom nodes. Being able to import `comfy` is not enough: `python -m qwen21_nodes` run from the ComfyUI folder
# can, and importing comfy.model_management there would set up ComfyUI's device in a process that is not ComfyUI
# (on a machine without a GPU it raises "Found no NVIDIA driver" unless ComfyUI was started with --cpu).
comfy_mm = comfy_patcher = comfy_utils = comfy_folder_paths = None
if "comfy.model_management" in sys.modules:
    try:  # guarded: the same node classes run in ComfyUI, in the runner and in CI without ComfyUI
        import comfy.model_management as comfy_mm
        import comfy.model_patcher as comfy_patcher
        import comfy.utils as comfy_utils
        import folder_paths as comfy_folder_paths
    except ImportError:
        comfy_mm = comfy_patcher = comfy_utils = comfy_folder_paths = None

IN_COMFYUI = comfy_mm is not None

# ComfyUI model-folder keys we read (they cover the legacy `unet` and `clip` folders too).
MODEL_FOLDERS = ("diffusion_models", "text_encoders", "vae", "diffusers", "loras")
WEIGHT_EXTENSIONS = (".safetensors", ".sft")


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
    return [os.path.join(_models_dir, kind)] if _models_dir else []


def list_weight_files(kind: str) -> list[str]:
    """Safetensors files under the `kind` folders, as paths relative to their folder (sorted)."""
    if IN_COMFYUI:
        return sorted(f for f in comfy_folder_paths.get_filename_list(kind) if f.endswith(WEIGHT_EXTENSIONS))
    found = set()
    for root in model_folders(kind):
        for dirpath, _dirs, files in _walk(root):
            for name in files:
                if name.endswith(WEIGHT_EXTENSIONS):
                    found.add(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return sorted(found)


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
        stat = os.stat(path)
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


def device_capacity_bytes(device: torch.device) -> int:
    """All the memory our models may have on `device`: ComfyUI's total VRAM, or the local budget / device size."""
    device = indexed_device(device)
    if device.type != "cuda":
        return 2**62
    if IN_COMFYUI:
        return int(comfy_mm.get_total_memory(device))
    total = torch.cuda.get_device_properties(device).total_memory
    total = int(total * torch.cuda.get_per_process_memory_fraction(device))
    return total if LOCAL.budget is None else min(total, LOCAL.budget)


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


# --------------------------------------------------------------------------------------------------
# Memory manager


class Qwen21Weights(torch.nn.Module):
    """What ComfyUI's ModelPatcher manages: our modules as children, plus the plain `device`
    attribute ModelPatcher writes (transformers models have a read-only `device` property)."""

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device):
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self.device = device


class ManagedModules:
    """Modules registered with a memory manager: ComfyUI's inside ComfyUI (it counts their VRAM, evicts other
    models to make room for them, moves them off when others need the room, and `POST /free` unloads them), or
    outside it the local one below when a VRAM budget is set. `on_unload` runs whenever they are really unloaded
    (free caches tied to them).

    `streamable` (the DiT, the text encoder) is the object that can run with only part of its layer stack on the
    device (`place(device, resident_layers)`, `layer_bytes`, `num_layers`, `device_weight_bytes()`): for it a
    partial load is honoured, the other layers stream from pinned host RAM. Other modules load whole.
    `evictable` False keeps the local manager from moving them off for another model (the text encoder with
    offload_text_encoder "never"); ComfyUI's manager has no such setting.
    """

    def __init__(
        self,
        modules: dict[str, torch.nn.Module],
        load_device: torch.device,
        on_unload: Callable[[], None] | None = None,
        streamable: StreamableStack | None = None,
    ):
        self.modules = modules
        self.load_device = torch.device(load_device)
        self.streamable = streamable
        self.on_unload = on_unload
        self.full_bytes = sum(p.numel() * p.element_size() for m in modules.values() for p in m.parameters())
        self.name = "+".join(modules)  # for logs: "transformer", "text_encoder", "vae"
        self.evictable = True
        self.patcher = None
        if not IN_COMFYUI:
            return
        holder = Qwen21Weights(modules, offload_device())
        if streamable is None:
            self.patcher = comfy_patcher.ModelPatcher(holder, load_device=load_device, offload_device=offload_device())
        else:
            self.patcher = _streaming_patcher_class()(holder, load_device, offload_device(), streamable)
        if on_unload is not None:
            on_detach = getattr(getattr(comfy_patcher, "CallbacksMP", None), "ON_DETACH", None)
            if on_detach is not None:  # older ComfyUI has no callbacks; caches then live until /free
                self.patcher.add_callback(on_detach, _on_real_unload(on_unload))

    def load(self, memory_required: int = 0) -> None:
        """Put the modules on their device (partly, for a streamable stack that does not fit), evicting other
        models if needed."""
        if self.patcher is not None:
            comfy_mm.load_models_gpu([self.patcher], memory_required=int(memory_required),
                                     force_full_load=self.streamable is None)  # fmt: skip
        else:
            LOCAL.load(self, int(memory_required))

    def unload(self) -> None:
        """Move the modules off their device now (as ComfyUI does when it needs the room)."""
        if self.patcher is not None:
            for index, loaded in enumerate(comfy_mm.current_loaded_models):
                if loaded.model is self.patcher:
                    comfy_mm.current_loaded_models.pop(index).model_unload()
                    comfy_mm.soft_empty_cache()
                    return
        else:
            LOCAL.offload(self)

    def released(self) -> None:
        """The modules left the device (the local manager calls it; ComfyUI's detach callback does the same)."""
        if self.on_unload is not None:
            self.on_unload()

    # ---- placement (the local manager and the ComfyUI patcher both come through here) ------------------------

    def device_bytes(self) -> int:
        if self.streamable is not None:
            return self.streamable.device_weight_bytes() if self._on(self.load_device) else 0
        return self.full_bytes if self._on(self.load_device) else 0

    def _on(self, device) -> bool:
        first = next((p for m in self.modules.values() for p in m.parameters()), None)
        return (
            first is not None
            and first.device == torch.device(device)
            or (
                first is not None
                and first.device.type == device.type == "cuda"
                and device.index in (None, first.device.index)
            )
        )

    def place(self, device, resident_layers: int | None = None) -> None:
        if self.streamable is not None:
            self.streamable.place(device, resident_layers)
        else:
            for module in self.modules.values():
                module.to(device)

    def resident_for(self, weight_budget: int) -> int | None:
        """How many layers of the streamable stack fit `weight_budget` bytes of weights (None: all of them)."""
        if self.streamable is None or weight_budget >= self.full_bytes:
            return None
        s = self.streamable
        fixed = self.full_bytes - s.num_layers * s.layer_bytes + 2 * s.layer_bytes  # non-layer weights, 2 slots
        return max(0, min(s.num_layers, (weight_budget - fixed) // s.layer_bytes))


LOCAL = LocalMemoryManager()  # outside ComfyUI: places our models (qwen21_core/memory/manager.py)


def set_vram_budget(budget_bytes: int | None) -> None:
    """Outside ComfyUI: cap the device memory our models and caches plan with (None: the whole device)."""
    LOCAL.budget = None if budget_bytes is None else int(budget_bytes)


def _streaming_patcher_class():
    """ComfyUI's ModelPatcher, with partial loads that stream a layer stack (our modules are plain torch layers,
    not comfy.ops casting layers, so the stock partial load would leave them half on the CPU)."""

    class StreamingPatcher(comfy_patcher.ModelPatcher):
        def __init__(self, model, load_device, offload_device, streamable, size=0, weight_inplace_update=False):
            super().__init__(model, load_device, offload_device, size, weight_inplace_update)
            self.streamable = streamable

        def clone(self):
            clone = super().clone()
            clone.streamable = self.streamable
            return clone

        def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
            device_to = device_to or self.load_device
            size = self.model_size()
            whole = full_load or lowvram_model_memory == 0 or lowvram_model_memory >= size
            managed = _Budget(self.streamable, size)
            resident = None if whole else managed.resident_for(int(lowvram_model_memory))
            self.streamable.place(device_to, resident)
            loaded = self.streamable.device_weight_bytes()
            self.model.model_lowvram = resident is not None
            self.model.lowvram_patch_counter = 0
            self.model.device = device_to
            self.model.model_loaded_weight_memory = loaded
            self.model.current_weight_patches_uuid = self.patches_uuid
            layers = "whole" if resident is None else f"{resident}/{self.streamable.num_layers} layers resident"
            log.info("qwen21: %s on %s (%s)", type(self.streamable).__name__, device_to, layers)
            for callback in self.get_all_callbacks(comfy_patcher.CallbacksMP.ON_LOAD):
                callback(self, device_to, lowvram_model_memory, force_patch_weights, full_load)

        def partially_unload(self, device_to, memory_to_free=0):
            s = self.streamable
            before = s.device_weight_bytes()
            keep = max(0, before - int(memory_to_free))
            s.place(self.load_device, _Budget(s, self.model_size()).resident_for(keep))
            freed = before - s.device_weight_bytes()
            self.model.model_lowvram = True
            self.model.model_loaded_weight_memory = s.device_weight_bytes()
            return freed

        def unpatch_model(self, device_to=None, unpatch_weights=True):
            if unpatch_weights and device_to is not None:
                self.streamable.place(device_to)  # streaming off, everything whole on the offload device
            super().unpatch_model(device_to, unpatch_weights)

    return StreamingPatcher


class _Budget:
    """ManagedModules.resident_for for a streamable alone (the patcher has no ManagedModules at hand)."""

    def __init__(self, streamable, full_bytes: int):
        self.streamable, self.full_bytes = streamable, full_bytes

    resident_for = ManagedModules.resident_for


def _on_real_unload(on_unload: Callable[[], None]) -> Callable:
    """A ModelPatcher ON_DETACH callback that calls `on_unload` only when the weights really leave.

    ComfyUI also detaches a loaded model each time it is asked to load it again (load_models_gpu treats
    a model as a clone of itself), with unpatch_all=False and the weights left in place; freeing our
    decode graphs then would throw them away at every run.
    """

    def on_detach(_patcher, unpatch_all=True):
        if unpatch_all:
            on_unload()

    return on_detach
