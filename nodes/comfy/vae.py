"""Our VAE behind ComfyUI's VAE type, so VAE Decode, VAE Decode (Tiled) and VAE Encode take it. Imported only inside
ComfyUI (the loaders make it there).

Decoding is ours: the exact decode (bit-identical to the reference), tiled only when memory requires (VAE Decode) or
when asked (VAE Decode (Tiled)). VAE Decode gives ComfyUI's IMAGE, RGB [B, H, W, 3], so every image node downstream
(blends, inverts, savers) sees what it expects; Qwen21 VAE Decode is the node that gives the alpha too (as a MASK)
and offers the fast path. The weights load through the same memory adapter (nodes/memory_adapter.py) as with our
own nodes.
"""

from __future__ import annotations

import comfy.sd
import torch

from .. import host

SCALE = 16  # pixels per latent side


class Qwen21ComfyVAE(comfy.sd.VAE):
    def __init__(self, handle):  # comfy.sd.VAE's own __init__ builds a VAE from a state dict: not used
        self.handle = handle
        vae = handle.pipe.vae
        self.first_stage_model = vae
        self.patcher = handle.vae.patcher
        self.device = handle.pipe.vae_execution_device
        self.vae_dtype = next(vae.parameters()).dtype
        self.output_device = host.intermediate_device()
        self.downscale_ratio = self.upscale_ratio = SCALE
        self.latent_channels = vae.config.z_dim
        self.latent_dim = 2
        self.output_channels = 3
        self.disable_offload = False
        self.extra_1d_channel = None
        self.not_video = True

    def throw_exception_if_invalid(self):
        pass

    def _latents(self, samples: torch.Tensor) -> torch.Tensor:
        if samples.dim() != 4 or samples.shape[1] != self.latent_channels:
            raise ValueError(f"Qwen21 VAE: latents must be [B, {self.latent_channels}, H/16, W/16] (Qwen-Image-2.1's), "
                             f"got {list(samples.shape)}")  # fmt: skip
        return samples

    def decode(self, samples_in, vae_options={}):  # noqa: B006 - ComfyUI's signature
        rgba = self.handle.decode(self._latents(samples_in), tiling="auto", check_interrupt=host.check_interrupted)
        return rgba[..., :3].to(self.output_device, torch.float32).contiguous()

    def decode_tiled(self, samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        tile = max(tile_x or 0, tile_y or 0) * SCALE or None
        rgba = self.handle.decode(self._latents(samples), tiling="on", tile_size=tile,
                                  check_interrupt=host.check_interrupted)  # fmt: skip
        return rgba[..., :3].to(self.output_device, torch.float32).contiguous()

    def vae_encode_crop_pixels(self, pixels):
        """Pixels cropped around the centre to multiples of 16 (what the encoder takes)."""
        height, width = (pixels.shape[1] // SCALE) * SCALE, (pixels.shape[2] // SCALE) * SCALE
        top, left = (pixels.shape[1] - height) // 2, (pixels.shape[2] - width) // 2
        return pixels[:, top : top + height, left : left + width, :]

    def encode(self, pixel_samples):
        if pixel_samples.dim() != 4 or pixel_samples.shape[-1] not in (3, 4):
            raise ValueError(f"Qwen21 VAE: images must be [B, H, W, 3 or 4], got {list(pixel_samples.shape)}")
        latents = self.handle.encode_image(self.vae_encode_crop_pixels(pixel_samples), None)
        return latents.to(self.output_device)

    def encode_tiled(self, pixel_samples, tile_x=None, tile_y=None, overlap=None, tile_t=None, overlap_t=None):
        return self.encode(pixel_samples)  # the encoder's memory does not call for tiles at the sizes it takes

    def get_sd(self):
        raise ValueError("the Qwen21 VAE cannot be saved as a state dict from ComfyUI; use its file")

    def spacial_compression_decode(self):
        return SCALE

    def spacial_compression_encode(self):
        return SCALE

    def temporal_compression_decode(self):
        return None
