"""LoRA files as read, the latest few kept: a strength change or a switch back to a recent LoRA takes the tensors
read before instead of reading the file again (as ComfyUI's LoraLoader keeps its last file), while an edited file
(another size or modification time) is read again."""

from __future__ import annotations

import dataclasses
import os

from .merge import layer_shapes
from .reading import LoraFile, read_lora

READ_LORAS_KEPT = 2  # a large LoRA's tensors take as much host RAM as its file: keep only the latest few


class ReadLoras:
    def __init__(self, kept: int = READ_LORAS_KEPT):
        self.kept = kept
        self.entries: dict[tuple, LoraFile] = {}  # (path, size, mtime) -> the file as read, latest last

    def load(self, path, transformer, side_path: bool = False) -> LoraFile:
        """The LoRA file at `path`, checked against `transformer`'s layers (nothing is merged yet); side_path: see
        Qwen21Pipeline.load_lora."""
        stat = os.stat(path)
        key = (os.path.abspath(path), stat.st_size, stat.st_mtime_ns)
        lora = self.entries.pop(key, None)
        if lora is None:
            lora = read_lora(path, layer_shapes(transformer))
        self.entries[key] = lora  # most recent last
        while len(self.entries) > self.kept:
            self.entries.pop(next(iter(self.entries)))
        return dataclasses.replace(lora, side_path=side_path)
