"""What the encoder hands the sampler: prompt embeddings, condition latents and the output size.

The text encoder (text/encoder.py) builds it; the sampler (sampler.py) reads it. It holds tensors
only (no modules), so it can be cached, hashed, moved between devices and passed through ComfyUI
links.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptEmbedding:
    """One prompt's Qwen3-VL encoding, system turn dropped, no padding.

    embeds:          [L, context_dim] last decoder layer's hidden state before the final norm.
    image_pad_mask:  [L] bool, True at the <|image_pad|> slots; each slot stands for a 2x2 group of
                     condition-latent tokens (slot k of an image covers its latent tokens 4k..4k+3).
    """

    embeds: torch.Tensor
    image_pad_mask: torch.Tensor

    def __post_init__(self):
        if self.embeds.dim() != 2:
            raise ValueError(f"prompt embeds must be [L, C], got shape {tuple(self.embeds.shape)}")
        if self.image_pad_mask.shape != self.embeds.shape[:1] or self.image_pad_mask.dtype != torch.bool:
            raise ValueError(
                f"image_pad_mask must be a bool [L={self.embeds.shape[0]}] tensor, got "
                f"{self.image_pad_mask.dtype} {tuple(self.image_pad_mask.shape)}"
            )

    @property
    def length(self) -> int:
        return self.embeds.shape[0]

    def to(self, device=None, dtype=None) -> PromptEmbedding:
        return PromptEmbedding(self.embeds.to(device=device, dtype=dtype), self.image_pad_mask.to(device=device))


@dataclass
class Conditioning:
    """Everything one generation request is conditioned on.

    positive / negative:  prompt encodings; the negative one (if any) is encoded with the same images.
    condition_latents:    one [z_dim, h_i, w_i] tensor per condition image, VAE-encoded (mode) and
                          normalised with the VAE's latents_mean/std, in slot order.
    width, height:        output size in pixels derived by the encoder (multiples of 32).
    content_hash:         hex digest over prompts, images and encoder settings, for cache reuse.
    """

    positive: PromptEmbedding
    negative: PromptEmbedding | None = None
    condition_latents: tuple[torch.Tensor, ...] = ()
    width: int = 1024
    height: int = 1024
    content_hash: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.condition_latents = tuple(self.condition_latents)
        for prompt in (self.positive, self.negative):
            if prompt is None:
                continue
            slots = int(prompt.image_pad_mask.sum())
            expected = sum(lat.shape[-2] * lat.shape[-1] // 4 for lat in self.condition_latents)
            if slots != expected:
                raise ValueError(
                    f"the prompt has {slots} image slots but the {len(self.condition_latents)} condition latents "
                    f"need {expected} (one slot per 2x2 latent tokens)"
                )

    @property
    def image_shapes(self) -> list[tuple[int, int]]:
        """Latent grid (h, w) of each condition image."""
        return [(lat.shape[-2], lat.shape[-1]) for lat in self.condition_latents]

    @property
    def num_images(self) -> int:
        return len(self.condition_latents)
