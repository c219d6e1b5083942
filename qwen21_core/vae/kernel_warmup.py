"""Compile the Triton kernels a VAE decode and encode launch, before the first image needs them.

The exact decode's kernels are used only after self-tests proved them bit-identical to torch on the device
(kernels/rmsnorm_silu.py, kernels/bias_residual.py); those run here first. Then decodes of 2x2, 4x4 and 16x16 latents
and an encode of a 32x32 image: Triton specialises integer arguments (pixel counts, strides) on whether they are
multiples of 16, which at the first decoder stages they are for some image sizes and not for others. 2x2 and 4x4
latents give the first stages sizes that are not; 16x16 latents give every stage sizes that are, as a 1024x1024
image's: without them its first decode compiled the norm kernel's tail again, on the user's time (in the first image
that decodes with the kernels).

Like the DiT's, it runs on a copy (the VAE is small), so the model itself stays free to be used or moved, and as
small jobs on the warm-up's thread pool (qwen21_core/startup/warmup.py): the self-tests apart from the decodes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...kernels import bias_residual, rmsnorm_silu
from ..startup.warmup import shared_copy
from .model import QwenImage21VAE

LATENT_SIDES = (2, 4, 16)


def vae_warmup_jobs(vae: QwenImage21VAE, device: torch.device) -> list[Callable[[], None]]:
    """Independent jobs for a thread pool: each self-test, the small decodes, the small encode (one shared copy of
    the VAE: its exact path keeps no state between calls)."""
    dtype = vae.dtype
    model = shared_copy(vae, device)

    def decode():
        for side in LATENT_SIDES:
            model().decode(torch.zeros(1, vae.config.z_dim, side, side, device=device), tiling="off")

    return [
        lambda: rmsnorm_silu.eager_kernel_verified(device, dtype),
        lambda: rmsnorm_silu.direct_norm_verified(device, dtype),
        lambda: bias_residual.epilogue_verified(device, dtype),
        decode,
        lambda: model().encode(torch.zeros(1, 32, 32, 4, device=device), tiling="off"),
    ]
