"""Tiny random VAEs for the VAE tests: ours, and diffusers' reference holding the same weights."""

from __future__ import annotations

import torch
from qwen21_nodes.qwen21_core.config import VAEConfig
from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE

# 5 stages (16x, like the released model), temporal flags as released, 2 resnets per encoder stage,
# decoder wider than the encoder, different channel counts per stage (so every shortcut kind is exercised:
# 1x1 conv shortcuts, the channel-halving DupUp of temporal and spatial-only up blocks).
TINY_VAE = VAEConfig(
    base_dim=8,
    decoder_base_dim=12,
    z_dim=4,
    dim_mult=(1, 2, 4, 4, 4),
    num_res_blocks=2,
    temperal_downsample=(False, True, True, True),
    latents_mean=(0.1, -0.2, 0.3, 0.4),
    latents_std=(1.0, 2.0, 0.5, 1.5),
)


def randomize_(vae: torch.nn.Module, seed: int = 0) -> None:
    """Weights that keep activations O(1) and outputs mostly inside (-1, 1), so clamping hides nothing."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 4:
                fan_in = p.shape[1] * p.shape[2] * p.shape[3]
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        for name, p in vae.named_parameters():
            if name.startswith("decoder.conv_out."):
                p.mul_(0.3)


def our_vae(config: VAEConfig = TINY_VAE, seed: int = 0) -> QwenImage21VAE:
    vae = QwenImage21VAE(config).eval()
    randomize_(vae, seed)
    return vae


def vae_pair(config: VAEConfig = TINY_VAE, seed: int = 0):
    """(ours, diffusers' AutoencoderKLQwenImage21) holding the same random weights; the reference's unused
    time_conv weights are random too (they must not matter)."""
    from diffusers import AutoencoderKLQwenImage21

    ref = AutoencoderKLQwenImage21(**config.to_dict()).eval()
    randomize_(ref, seed)
    ours = QwenImage21VAE(config).eval()
    ours.load_diffusers_state_dict(ref.state_dict())
    return ours, ref


def psnr(a: torch.Tensor, b: torch.Tensor, peak: float = 1.0) -> float:
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10.0 * torch.log10(torch.tensor(peak**2 / mse)).item()
