"""The pipeline's two VAE calls: a decode that records what it did (its path, time and peak memory, for the node's
status line) and an encode of ComfyUI images with their masks. Each holds the VAE's kernel warm-up first, so a call
never uses a kernel that is still compiling (startup/model_warmup.py)."""

from __future__ import annotations

import time

import torch

from ..images import masks_at_image_size
from ..startup import model_warmup


def vae_device(vae) -> torch.device:
    return next(vae.parameters()).device


def decode(vae, latents: torch.Tensor, warmup=None, **options) -> tuple[torch.Tensor, dict]:
    """Raw latents [B, 64, h, w] -> (RGBA [B, 16h, 16w, 4] in 0..1, the decode's stats). Options: the VAE's decode."""
    if latents.dim() != 4 or 0 in latents.shape:
        raise ValueError(f"the VAE decodes latents [B, 64, h, w] with at least one of each, got {list(latents.shape)}")
    device = vae_device(vae)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    with model_warmup.vae_kernels(warmup, options.get("quality", "exact")):
        images = vae.decode(latents.to(device), **options)
    stats = dict(getattr(vae, "last_decode_info", {}) or {})
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the images are used right away anyway; this makes the time real
    stats["seconds"] = round(time.perf_counter() - started, 3)
    if device.type == "cuda":
        stats["peak_vram_mib"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return images, stats


def encode(vae, images: torch.Tensor, masks: torch.Tensor | None = None, warmup=None, **options) -> torch.Tensor:
    """ComfyUI IMAGE [B, H, W, 3|4] (+ MASK [B, H, W] = 1 - alpha) -> raw latents [B, 64, H/16, W/16]."""
    if images.dim() != 4 or images.shape[-1] not in (3, 4) or 0 in images.shape:
        raise ValueError(f"images must be [B, H, W, 3 or 4] with at least one of each, got {list(images.shape)}")
    if masks is not None:
        if masks.dim() == 2:
            masks = masks[None]
        masks = masks_at_image_size(masks, *images.shape[1:3], "the mask", "the image")
        alpha = (1.0 - masks.float()).clamp(0, 1).expand(images.shape[0], -1, -1)[..., None]
        images = torch.cat([images[..., :3].float(), alpha.to(images.device)], dim=-1)
    with model_warmup.vae_kernels(warmup, "exact"):
        return vae.encode(images.to(vae_device(vae)), **options)
