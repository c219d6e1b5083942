"""Cheap live previews: a linear projection of the 64 latent channels to RGB, no VAE decode.

The projection is fitted once per loaded model from the VAE itself: encode a few smooth random
colour images and solve least squares from each latent vector to the mean colour of its 16x16
patch. That is all a preview needs and it follows whatever VAE is loaded.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from PIL import Image

PATCH = 16  # pixels per latent token side


def fit_latent_rgb(encode: Callable[[torch.Tensor], torch.Tensor], images: int = 8, size: int = 128, seed: int = 0):
    """Fit factors [C, 3] and bias [3] with rgb (-1..1) ~= latent @ factors + bias.

    encode: IMAGE [B, H, W, 3] in 0..1 -> raw latents [B, C, H/16, W/16].
    """
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(images, 3, 4, 4, generator=generator)
    pixels = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1)
    latents = encode(pixels.permute(0, 2, 3, 1).contiguous()).float().cpu()
    targets = F.avg_pool2d(pixels * 2 - 1, PATCH)
    inputs = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
    inputs = torch.cat([inputs, torch.ones(inputs.shape[0], 1)], dim=1)
    solution = torch.linalg.lstsq(inputs, targets.permute(0, 2, 3, 1).reshape(-1, 3)).solution
    return solution[:-1], solution[-1]


def latent_to_preview(latents: torch.Tensor, factors: torch.Tensor, bias: torch.Tensor) -> Image.Image:
    """First image of raw latents [B, C, h, w] -> an RGB PIL image of w x h pixels."""
    rgb = torch.einsum("chw,cr->hwr", latents[0].float().cpu(), factors) + bias
    pixels = ((rgb + 1.0) * 127.5).clamp(0, 255).to(torch.uint8)
    return Image.fromarray(pixels.numpy())
