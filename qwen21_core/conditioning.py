"""What the encoder hands the sampler: prompt embeddings, condition latents and the output size.

The text encoder (text/encoder.py) builds it; the sampler (sampler.py) reads it. It holds tensors
and plain data only (no modules), so it can be cached, hashed and passed through ComfyUI links.

The negative prompt is encoded lazily: most generations run at true_cfg_scale 1 and never read it, and
encoding it costs a full VLM pass over every condition image. Until a sampler needs it, the
Conditioning keeps what encoding it takes (`PendingPrompt`); the pipeline fills `negative` in once.
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


@dataclass(frozen=True)
class PendingPrompt:
    """A prompt not encoded yet: its text, the condition images as the VLM sees them (RGB PIL, resized
    exactly as for the positive prompt) and the length its embedding will have (from the tokenizer)."""

    text: str
    vlm_images: tuple = ()
    length: int = 0


@dataclass
class Conditioning:
    """Everything one generation request is conditioned on.

    positive / negative:  prompt encodings; the negative one (if any) is encoded with the same images.
    negative_pending:     the negative prompt while it is not encoded yet (then `negative` is None);
                          `Qwen21Pipeline.encode_negative` encodes it when true_cfg_scale > 1 needs it.
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
    negative_pending: PendingPrompt | None = None

    def __post_init__(self):
        self.condition_latents = tuple(self.condition_latents)
        if self.negative is not None and self.negative_pending is not None:
            raise ValueError("a Conditioning has either an encoded negative prompt or a pending one, not both")
        for prompt in (self.positive, self.negative):
            if prompt is not None:
                self._check_slots(prompt)

    def _check_slots(self, prompt: PromptEmbedding) -> None:
        slots = int(prompt.image_pad_mask.sum())
        expected = sum(lat.shape[-2] * lat.shape[-1] // 4 for lat in self.condition_latents)
        if slots != expected:
            raise ValueError(
                f"the prompt has {slots} image slots but the {len(self.condition_latents)} condition latents "
                f"need {expected} (one slot per 2x2 latent tokens)"
            )

    def set_negative(self, embedding: PromptEmbedding) -> None:
        """Store the encoding of the pending negative prompt (the pending inputs are dropped)."""
        self._check_slots(embedding)
        self.negative, self.negative_pending = embedding, None

    @property
    def has_negative(self) -> bool:
        """A negative prompt was given (encoded or pending)."""
        return self.negative is not None or self.negative_pending is not None

    @property
    def negative_length(self) -> int | None:
        """Tokens of the negative prompt's embedding (known before it is encoded), None without one."""
        if self.negative is not None:
            return self.negative.length
        return None if self.negative_pending is None else self.negative_pending.length

    @property
    def image_shapes(self) -> list[tuple[int, int]]:
        """Latent grid (h, w) of each condition image."""
        return [(lat.shape[-2], lat.shape[-1]) for lat in self.condition_latents]

    @property
    def num_images(self) -> int:
        return len(self.condition_latents)
