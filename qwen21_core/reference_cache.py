"""Condition images seen before: their resized copies and VAE latents, kept so that a reference used again costs
nothing but its digest.

Someone editing keeps the reference and changes the prompt. Without this, every such prompt resized each
reference again (PIL lanczos, slow on one core), made its float copy, hashed that 16 MB copy for the prefix cache's
key and ran the VAE encoder on it, which made an edit's encode take much longer than a text prompt's, more so with
every reference (bench_edit_encode.py measures it). The vision tower still runs with every prompt: the text and the
image tokens go through the language model together.

An entry is found by the source image's digest (`images.source_digest`: its RGBA bytes and size) and the output
resolution; its latents by the VAE's identity and device as well. At most `max_images` entries, least recently
used first out; an entry holds the resized RGBA (4 MB at 1024^2), the VLM's RGB copy (3 MB) and its latents
(a few hundred KB per VAE, on the VAE's device). `max_images=0` keeps nothing (each call computes).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from PIL import Image

from .images import MAX_CONDITION_IMAGES, ConditionImage, prepare_condition_image, source_digest

DEFAULT_MAX_IMAGES = MAX_CONDITION_IMAGES  # as many as one prompt may carry: a prompt never evicts its own images


@dataclass
class _Entry:
    image: ConditionImage
    latents: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)


class ReferenceCache:
    def __init__(self, max_images: int = DEFAULT_MAX_IMAGES):
        self.max_images = max_images
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def prepare(self, rgba: Image.Image, output_resolution: int) -> ConditionImage:
        """`images.prepare_condition_image(rgba, output_resolution)`, from the cache when this image came before."""
        digest = source_digest(rgba)
        key = (digest, output_resolution)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry.image
            self.misses += 1
        image = prepare_condition_image(rgba, output_resolution, digest=digest)
        with self._lock:
            if self.max_images > 0:
                self._entries[key] = _Entry(image)
                while len(self._entries) > self.max_images:
                    self._entries.popitem(last=False)
        return image

    def latents(self, image: ConditionImage, output_resolution: int, vae_identity: str, vae_device,
                encode: Callable[[], torch.Tensor]) -> torch.Tensor:  # fmt: skip
        """The latents of an image `prepare` gave: `encode()` the first time for this VAE (its identity and device),
        kept after. The tensors are shared between conditionings: nothing may write into them (the sampler only
        reads them)."""
        vae_key = (vae_identity, str(vae_device))
        with self._lock:
            entry = self._entries.get((image.digest, output_resolution))
            if entry is not None and entry.image is not image:
                entry = None  # an image prepared elsewhere, or its entry was replaced meanwhile
            if entry is not None and vae_key in entry.latents:
                return entry.latents[vae_key]
        latents = encode()
        if entry is not None:
            with self._lock:
                entry.latents[vae_key] = latents
        return latents

    def clear(self) -> None:
        """Forget every image, and the counts (`hits` and `misses` count since the last clear)."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0
