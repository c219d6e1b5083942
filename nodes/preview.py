"""Cheap live previews: a linear projection of the 64 latent channels to RGB, no VAE decode."""

from __future__ import annotations

import torch
from PIL import Image


def latent_to_preview(latents: torch.Tensor, factors: torch.Tensor, bias: torch.Tensor) -> Image.Image:
    """First image of raw latents [B, 64, h, w] -> an RGB PIL image of h x w pixels.

    factors [64, 3] and bias [3] map a latent vector to RGB in -1..1.
    """
    rgb = torch.einsum("chw,cr->hwr", latents[0].float().cpu(), factors.float().cpu()) + bias.float().cpu()
    pixels = ((rgb + 1.0) * 127.5).clamp(0, 255).to(torch.uint8)
    return Image.fromarray(pixels.numpy())
