"""ComfyUI CONDITIONING <-> our Conditioning, in native ComfyUI's Qwen-Image-2.1 layout.

An entry is `[context [1, L, C], {...}]`: the prompt's hidden states without the image-pad rows, and in the dict
`image_slots` (where each image's pads were), `reference_latents` (raw VAE latents [1, 64, h, w], one per image) and,
on entries Qwen21 Encode made, our marker `qwen21`. The tensors decide what the model sees; the marker only saves the
conversion (and keeps the content hash) while they are unchanged. Plain data and torch only: no ComfyUI import, so
the encode node builds these outside ComfyUI too.

The negative prompt stays lazy as it is in our own sampler: Qwen21 Encode's negative CONDITIONING holds a
placeholder of the right shape and a `PendingNegative`; the MODEL's sampling wrapper (nodes/comfy/sampling.py)
encodes it only when guidance will use it (cfg other than 1), once per conditioning, before the DiT is loaded.
Unused, it stays unencoded: the model is handed the PendingNegative itself, and refuses it if it is ever asked
for it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ...qwen21_core.conditioning import (
    Conditioning,
    PendingPrompt,
    content_digest,
    context_without_slots,
    prompt_with_slots,
)
from ...qwen21_core.request import LATENT_SCALE

log = logging.getLogger(__name__)

MARKER = "qwen21"


@dataclass(eq=False)
class Emitted:
    """What Qwen21 Encode put in an entry: the Conditioning and the very tensors it was emitted with."""

    cond: Conditioning
    context: torch.Tensor
    references: list | None


@dataclass(eq=False)
class PendingNegative:
    """A negative prompt not encoded yet. `placeholder` stands in for its context (zeros of its shape) until
    `resolve` encodes it through the model handle, which places the text encoder."""

    handle: object  # nodes/model.py Qwen21Model
    cond: Conditioning  # the request; its negative_pending is encoded into cond.negative
    placeholder: torch.Tensor
    references: list | None
    emitted: Emitted | None = None

    def resolve(self) -> Emitted:
        if self.emitted is None:
            self.handle.encode_negative(self.cond)
            negative = negative_conditioning(self.cond)
            context, _slots = context_without_slots(negative.positive)
            self.emitted = Emitted(negative, context[None].float().to(self.placeholder.device), self.references)
        return self.emitted


def negative_conditioning(cond: Conditioning) -> Conditioning:
    """The encoded negative prompt of `cond` as a conditioning of its own (its prompt in `positive`)."""
    return Conditioning(cond.negative, condition_latents=cond.condition_latents, width=cond.width, height=cond.height,
                        content_hash=f"{cond.content_hash}:negative" if cond.content_hash else "")  # fmt: skip


def raw_latents(cond: Conditioning, mean, std, device) -> list[torch.Tensor] | None:
    """The condition images' latents as ComfyUI carries them (raw, [1, 64, h, w]); None without images."""
    if not cond.condition_latents:
        return None
    mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return [(latent.float().cpu() * std + mean)[None].to(device) for latent in cond.condition_latents]


def with_empty_negative(handle, cond: Conditioning) -> Conditioning:
    """`cond` with an empty negative prompt pending (KSampler always has a negative; ours samples without one when
    the user gave none). Encoded as " ", as the reference encodes an empty prompt, with the same images."""
    if cond.negative is not None or cond.negative_pending is not None:
        return cond
    pads = [h * w // 4 for h, w in cond.image_shapes]
    length = handle.pipe.text_encoder.count_tokens("", pads)
    pending = PendingPrompt("", tuple(cond.extra.get("vlm_images", ())), length)
    return dataclasses.replace(cond, negative_pending=pending)


def conditioning_entries(handle, cond: Conditioning, device) -> tuple[list, list]:
    """(positive CONDITIONING, negative CONDITIONING) of a request from Qwen21 Encode. The negative is pending
    unless it was encoded already (an empty negative prompt is encoded as the reference encodes one)."""
    vae = handle.pipe.vae.config
    references = raw_latents(cond, vae.latents_mean, vae.latents_std, device)
    context, slots = context_without_slots(cond.positive)
    context = context[None].float().to(device)
    extras = {} if references is None else {"reference_latents": references, "image_slots": slots}
    positive = [[context, {**extras, MARKER: Emitted(cond, context, references)}]]
    cond = with_empty_negative(handle, cond)
    if cond.negative is not None:
        emitted = Emitted(negative_conditioning(cond), None, references)
        negative_context, _ = context_without_slots(emitted.cond.positive)
        emitted.context = negative_context[None].float().to(device)
        return positive, [[emitted.context, {**extras, MARKER: emitted}]]
    pads = int(cond.positive.image_pad_mask.sum())
    length = cond.negative_pending.length - pads  # the negative sees the same images: the same pads
    placeholder = torch.zeros(1, length, context.shape[-1], device=device)
    pending = PendingNegative(handle, cond, placeholder, references)
    return positive, [[placeholder, {**extras, MARKER: pending}]]


def unencoded_negative(entry: dict) -> PendingNegative | None:
    """The entry's negative prompt if it is still pending (its context the placeholder, not changed by a node)."""
    marker = entry.get(MARKER)
    if isinstance(marker, PendingNegative) and entry.get("cross_attn") is marker.placeholder:
        return marker
    return None


def resolve_pending(entry: dict) -> bool:
    """Encode an entry's pending negative in place (its context, marker); False if it had none or was changed."""
    marker = unencoded_negative(entry)
    if marker is None:
        return False
    emitted = marker.resolve()
    entry["cross_attn"], entry[MARKER] = emitted.context, emitted
    return True


def conditioning_from_entry(entry: dict, pipe) -> Conditioning | PendingNegative:
    """Our Conditioning for one CONDITIONING entry as ComfyUI hands it to the model (the dict, its tensor under
    `cross_attn`); a negative left unencoded (the guidance does not use it) as its PendingNegative. Refuses, by
    name, what is not a Qwen-Image-2.1 conditioning."""
    pending = unencoded_negative(entry)
    if pending is not None:
        return pending
    context = entry.get("cross_attn")
    references = entry.get("reference_latents")
    marker = entry.get(MARKER)
    if isinstance(marker, Emitted) and context is marker.context and references is marker.references:
        return marker.cond
    return conditioning_from_tensors(context, entry, pipe)


def conditioning_from_tensors(context, entry: dict, pipe) -> Conditioning:
    config = pipe.transformer.config
    width = config.context_in_dim
    pooled = entry.get("pooled_output")
    if isinstance(pooled, torch.Tensor):
        raise ValueError("Qwen21 MODEL: this CONDITIONING has a pooled output, as CLIP / T5 text encoders give; "
                         "Qwen-Image-2.1 needs one from Qwen21 Encode or native TextEncodeQwenImage21 "
                         "(Qwen3-VL-8B)")  # fmt: skip
    if not isinstance(context, torch.Tensor) or context.dim() != 3 or context.shape[-1] != width:
        got = list(context.shape) if isinstance(context, torch.Tensor) else type(context).__name__
        raise ValueError(f"Qwen21 MODEL: a CONDITIONING of {got} is from another model's text encoder; Qwen-Image-2.1 "
                         f"takes [1, tokens, {width}] from Qwen21 Encode or native TextEncodeQwenImage21")  # fmt: skip
    if context.shape[0] != 1:
        raise ValueError(f"Qwen21 MODEL: a CONDITIONING holds one prompt, this one {context.shape[0]}; encode each "
                         "prompt on its own (ConditioningCombine runs several)")  # fmt: skip
    context = _without_padding(context[0], entry.get("attention_mask"))
    references = list(entry.get("reference_latents") or [])
    channels = config.in_channels
    for index, latent in enumerate(references):
        if latent.dim() != 4 or latent.shape[:2] != (1, channels) or latent.shape[2] % 2 or latent.shape[3] % 2:
            raise ValueError(f"Qwen21 MODEL: reference latent {index + 1} is {list(latent.shape)}; expected [1, "
                             f"{channels}, h, w] with even h and w (a Qwen-Image-2.1 VAE latent of a multiple of "
                             "32 px)")  # fmt: skip
    slots = list(entry.get("image_slots") or [])
    counts = [latent.shape[2] * latent.shape[3] // 4 for latent in references]
    prompt = prompt_with_slots(context.float().cpu(), slots, counts)
    vae = pipe.vae.config
    mean = torch.tensor(vae.latents_mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(vae.latents_std, dtype=torch.float32).view(1, -1, 1, 1)
    normalised = tuple(((latent.float().cpu() - mean) / std)[0] for latent in references)
    last = references[-1].shape if references else None
    size = (last[3] * LATENT_SCALE, last[2] * LATENT_SCALE) if references else (1024, 1024)
    return Conditioning(prompt, condition_latents=normalised, width=size[0], height=size[1],
                        content_hash=content_digest(prompt.embeds, prompt.image_pad_mask, *normalised))  # fmt: skip


def _without_padding(context: torch.Tensor, mask) -> torch.Tensor:
    """The prompt's rows without trailing padding (an attention mask of ones then zeros); other masks refused."""
    if mask is None:
        return context
    mask = torch.as_tensor(mask).reshape(-1).bool().cpu()
    if mask.shape[0] != context.shape[0]:
        raise ValueError(f"Qwen21 MODEL: the CONDITIONING's attention mask has {mask.shape[0]} entries for "
                         f"{context.shape[0]} tokens")  # fmt: skip
    kept = int(mask.sum())
    if not bool(mask[:kept].all()):
        raise ValueError("Qwen21 MODEL: a CONDITIONING with padding inside the prompt is not supported")
    return context[:kept]
