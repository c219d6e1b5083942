"""What the encoder hands the sampler: prompt embeddings, condition latents and the output size.

The text encoder (text/encoder.py) builds it; the sampler (sampler.py) reads it. It holds tensors
and plain data only (no modules), so it can be cached, hashed and passed through ComfyUI links.

The negative prompt is encoded lazily: most generations run at true_cfg_scale 1 and never read it, and
encoding it costs a full VLM pass over every condition image. Until a sampler needs it, the
Conditioning keeps what encoding it takes (`PendingPrompt`); the pipeline fills `negative` in once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
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


# ---------------------------------------------------------------------------------------------------------
# The other layout: text embeddings without the image-slot rows, each image's slots cut out at one index
# ---------------------------------------------------------------------------------------------------------
# Native ComfyUI's Qwen-Image-2.1 conditioning keeps the prompt's hidden states without the rows of the image pads and
# says where each image's run of pads was (`image_slots`, indices into the shortened sequence). Our DiT ignores the
# values of the pad rows (their positions take the image's latent tokens), so both layouts carry the same prompt.

TOKENS_PER_SLOT = 4  # latent tokens (2x2) per image-pad row


def context_without_slots(prompt: PromptEmbedding) -> tuple[torch.Tensor, list[int]]:
    """(the prompt's rows without the image pads [L - pads, C], the index in them where each image's pads were: each
    run of pad rows is one image's, as the encoder writes them between an image's vision start and end tokens)."""
    mask = prompt.image_pad_mask.detach().cpu()
    kept = prompt.embeds[~mask.to(prompt.embeds.device)]
    slots, before, previous = [], 0, False
    for is_pad in mask.tolist():
        if is_pad and not previous:
            slots.append(before)
        before += not is_pad
        previous = is_pad
    return kept, slots


def prompt_with_slots(context: torch.Tensor, image_slots: Sequence[int],
                      slot_counts: Sequence[int]) -> PromptEmbedding:  # fmt: skip
    """Our layout from the other: `context` [L, C] (or [1, L, C]), `image_slots` one index into it per image (where
    its pads go; missing ones go at the end), `slot_counts` each image's number of pad rows (latent tokens / 4).
    The pad rows are zeros: the DiT does not read them."""
    if context.dim() == 3 and context.shape[0] == 1:
        context = context[0]
    if context.dim() != 2:
        raise ValueError(f"prompt embeddings must be [L, C] or [1, L, C], got {list(context.shape)}")
    length = context.shape[0]
    slots = [int(s) for s in image_slots][: len(slot_counts)]
    slots += [length] * (len(slot_counts) - len(slots))
    if any(not 0 <= s <= length for s in slots) or slots != sorted(slots):
        raise ValueError(f"image slots must be increasing indices into the {length} prompt rows, "
                         f"got {list(image_slots)}")  # fmt: skip
    pieces, masks, start = [], [], 0
    for slot, count in zip(slots, slot_counts, strict=True):
        pieces += [context[start:slot], context.new_zeros(count, context.shape[1])]
        masks += [torch.zeros(slot - start, dtype=torch.bool), torch.ones(count, dtype=torch.bool)]
        start = slot
    pieces.append(context[start:])
    masks.append(torch.zeros(length - start, dtype=torch.bool))
    return PromptEmbedding(torch.cat(pieces), torch.cat(masks))


def content_digest(*parts) -> str:
    """A digest of tensors (their dtype, shape and bytes) and plain values: the identity of a conditioning built
    from tensors, under which its prefix K/V may be reused."""
    digest = hashlib.sha256(b"qwen21-conditioning-v1")
    for part in parts:
        if isinstance(part, torch.Tensor):
            tensor = part.detach().to("cpu").contiguous()
            digest.update(f"{tensor.dtype}{list(tensor.shape)}".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(part).encode())
    return digest.hexdigest()
