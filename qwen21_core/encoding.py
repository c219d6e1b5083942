"""Prompt + condition images -> `Conditioning`: the whole encoding step of a generation request.

Order of work: check the inputs, resize the images once, check that every image gets exactly one
`<|image_pad|>` token per 2x2 latent tokens, check (before any model runs) that the prompt and images fit
the DiT's rotary table and that the DiT's prefix K/V fits in the memory the caller says is free, then run
the VLM on the positive prompt and the VAE (mode, normalised with latents_mean/std).

The negative prompt is only tokenized here (its length is needed for memory estimates); the VLM runs on
it, with the same images, in `encode_negative`, which the pipeline calls only when true_cfg_scale > 1.
At cfg 1 it is never encoded and never counted against the prefix memory.

The reference (diffusers) has no image limit; the model's documentation says 4; native ComfyUI takes 16.
We accept up to 16 and fail clearly above that.
"""

from __future__ import annotations

import hashlib
import logging
import weakref
from dataclasses import dataclass

import torch

from .conditioning import Conditioning, PendingPrompt
from .config import TransformerConfig
from .dit.sequence import check_rotary_range, prefix_rotary_range
from .errors import stable_name
from .images import (
    MAX_CONDITION_IMAGES,
    MAX_SIDE,
    SIZE_MULTIPLE,
    ConditionImage,
    calculate_dimensions,
    condition_images_to_rgba,
    derive_output_size,
)
from .memory import planner
from .reference_cache import ReferenceCache

log = logging.getLogger(__name__)

LATENT_PIXELS = 16  # one latent token per 16x16 pixels (the VAE's downscale)
_HASH_VERSION = b"qwen21-conditioning-v2"  # v2: images by their source digest


@stable_name
class PrefixMemoryError(MemoryError):
    """The text + condition-image prefix K/V would not fit in the memory the caller has free."""


@dataclass(frozen=True)
class PrefixMemoryBudget:
    """What the DiT's prefix K/V cache costs per token, and how much memory is free for it.

    One prefix token stores K and V of `inner_dim` values in each of `num_layers` blocks, per CFG branch.
    The pipeline passes its DiT config, the GPU memory it has left after weights and activations, and the host RAM
    the cache may be pinned in (the sampler moves a prefix that does not fit the GPU there).
    """

    num_layers: int
    inner_dim: int
    dtype_bytes: int
    free_bytes: int
    host_bytes: int = 0

    @classmethod
    def for_transformer(cls, config: TransformerConfig, dtype: torch.dtype, free_bytes: int,
                        host_bytes: int = 0) -> PrefixMemoryBudget:  # fmt: skip
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls(config.num_layers, config.inner_dim, itemsize, free_bytes, host_bytes)

    def prefix_bytes(self, prefix_tokens: int) -> int:
        return prefix_tokens * self.num_layers * 2 * self.inner_dim * self.dtype_bytes


def prefix_budget(config: TransformerConfig, dtype: torch.dtype, device: torch.device, vram_budget: int | None = None,
                  leaving_encoder=None) -> PrefixMemoryBudget | None:  # fmt: skip
    """Room for the prefix K/V cache, checked before encoding: the GPU's free memory within `vram_budget` (the weights
    of `leaving_encoder`, a text encoder that leaves this GPU after encoding, counted as free) less a decode step's
    headroom, plus the RAM the sampler would move the cache to. None off CUDA, and where the RAM is unknown: no check
    rather than refusing what RAM might hold."""
    if device.type != "cuda":
        return None
    free = planner.device_free_bytes(device, vram_budget)
    if leaving_encoder is not None and planner.same_device(leaving_encoder.device, device):
        free += leaving_encoder.device_weight_bytes()
    host = planner.host_free_bytes()
    if host is None:
        return None
    return PrefixMemoryBudget.for_transformer(config, dtype, max(0, free - planner.DECODE_HEADROOM_BYTES), host)


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _check_inputs(prompt, negative_prompt, output_resolution, max_images) -> None:
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if negative_prompt is not None and not isinstance(negative_prompt, str):
        raise TypeError(f"negative_prompt must be a str or None, got {type(negative_prompt).__name__}")
    if (
        isinstance(output_resolution, bool)
        or not isinstance(output_resolution, int)
        or not SIZE_MULTIPLE <= output_resolution <= MAX_SIDE
        or output_resolution % SIZE_MULTIPLE
    ):
        raise ValueError(f"output_resolution must be an int multiple of {SIZE_MULTIPLE} from {SIZE_MULTIPLE} to "
                         f"{MAX_SIDE} (pixels per side), got {output_resolution!r:.40}")  # fmt: skip
    if isinstance(max_images, bool) or not isinstance(max_images, int) or not 1 <= max_images <= MAX_CONDITION_IMAGES:
        raise ValueError(f"max_images must be an int from 1 to {MAX_CONDITION_IMAGES}, got {max_images!r}")


def _check_pad_counts(text_encoder, images: list[ConditionImage], output_resolution: int) -> None:
    """Each image's <|image_pad|> count from the processor must equal its latent tokens / 4."""
    for index, image in enumerate(images, start=1):
        got = text_encoder.image_pad_count(image.width, image.height)
        if got != image.pad_tokens:
            min_pixels, max_pixels = text_encoder.pixel_limits()
            raise ValueError(
                f"condition image {index} is resized to {image.width}x{image.height}, for which the Qwen3-VL processor "
                f"makes {got} <|image_pad|> tokens, but the model needs {image.pad_tokens} (one per 32x32 pixels): "
                f"the processor resizes images outside {min_pixels}..{max_pixels} pixels itself. Choose an "
                f"output_resolution from {int(min_pixels**0.5)} to {int(max_pixels**0.5)} "
                f"(got {output_resolution})."
            )


def _check_prefix_memory(budget: PrefixMemoryBudget, prefix_tokens: dict[str, int]) -> None:
    needed = sum(budget.prefix_bytes(tokens) for tokens in prefix_tokens.values())
    if needed > budget.free_bytes + budget.host_bytes:
        branches = ", ".join(f"{name} {tokens} tokens" for name, tokens in prefix_tokens.items())
        negative = " true_cfg_scale 1 (no negative branch)," if "negative" in prefix_tokens else ""
        raise PrefixMemoryError(
            f"the prefix K/V cache needs {_gib(needed)} ({branches}; {budget.num_layers} layers x K,V x "
            f"{budget.inner_dim} x {budget.dtype_bytes} bytes per token) but only {_gib(budget.free_bytes)} is free "
            f"on the GPU and {_gib(budget.host_bytes)} in RAM. Use fewer condition images, a smaller "
            f"output_resolution,{negative} the sampler's kv_cache fp8 (half the size), or free GPU memory or RAM."
        )


def _prefix_tokens(prompt_length: int, pad_counts) -> int:
    """DiT prefix length of a prompt: every <|image_pad|> slot becomes 4 latent tokens."""
    return prompt_length + 3 * sum(pad_counts)


def _check_prompt_fits(prompt_length: int, image_sizes) -> None:
    """The DiT's rotary table must hold the prompt (`prompt_length` tokens with its <|image_pad|> slots) and its
    condition images (resized (width, height)); fails with the sampler's own message before any model runs."""
    pad_counts = [(w // SIZE_MULTIPLE) * (h // SIZE_MULTIPLE) for w, h in image_sizes]
    shapes = [(h // LATENT_PIXELS, w // LATENT_PIXELS) for w, h in image_sizes]
    low, high = prefix_rotary_range(prompt_length - sum(pad_counts), shapes)
    check_rotary_range(low, high, _prefix_tokens(prompt_length, pad_counts))


def check_prompt_length(text_encoder, prompt: str, source_sizes=(), output_resolution: int = 1024) -> None:
    """Fail fast, from the tokenizer alone, when a prompt with condition images of these (width, height) sizes
    (before resizing) would not fit the DiT's rotary table: the check `encode_conditioning` makes, for callers that
    want it before they place any weights (the Encode node)."""
    sizes = [calculate_dimensions(output_resolution**2, w / h) for w, h in source_sizes]
    pad_counts = [(w // SIZE_MULTIPLE) * (h // SIZE_MULTIPLE) for w, h in sizes]
    _check_prompt_fits(text_encoder.count_tokens(prompt, pad_counts), sizes)


# a VAE module's fingerprint, taken once: it reads weights back from the GPU (two copies that wait for the device),
# and every encode asks; a VAE's weights never change in place (no LoRA reaches it), a new VAE is a new module
_vae_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vae_identity(vae) -> str:
    """Names a VAE's weights and the dtype it computes in now (the same weights in another dtype encode other
    latents): for the content hash and for the reference cache's latents."""
    return f"{_vae_weights_identity(vae)}:{getattr(vae, 'dtype', '')}"


def _vae_weights_identity(vae) -> str:
    identity = getattr(vae, "identity", None)
    if identity is not None:
        return str(identity)
    if isinstance(vae, torch.nn.Module):
        if vae not in _vae_fingerprints:
            parameters = list(vae.parameters())
            fingerprint = hashlib.sha256()
            for tensor in (parameters[0], parameters[-1]) if parameters else ():
                fingerprint.update(tensor.detach().flatten()[:256].float().cpu().numpy().tobytes())
            _vae_fingerprints[vae] = f"{type(vae).__qualname__}:{fingerprint.hexdigest()[:16]}"
        return _vae_fingerprints[vae]
    # Unknown object: never share a cache entry with another instance.
    return f"{type(vae).__qualname__}@{id(vae)}"


def _content_hash(prompt, negative_prompt, images, width, height, output_resolution, text_encoder, vae) -> str:
    digest = hashlib.sha256(_HASH_VERSION)

    def add(value) -> None:
        data = value if isinstance(value, bytes) else str(value).encode()
        digest.update(len(data).to_bytes(8, "little") + data)  # length-prefixed: no ambiguous joins

    add(prompt)
    add("<no negative prompt>" if negative_prompt is None else "negative:" + negative_prompt)
    for image in images:
        add(f"{image.width}x{image.height}")
        add(image.digest)  # the source image; with the output resolution below, it fixes what both encoders read
    add(f"{width}x{height}@{output_resolution}")
    add(text_encoder.identity)
    add(_vae_identity(vae))
    return digest.hexdigest()


def encode_conditioning(
    text_encoder,
    vae,
    prompt: str,
    images=(),
    masks=None,
    negative_prompt: str | None = None,
    output_resolution: int = 1024,
    width: int | None = None,
    height: int | None = None,
    max_images: int = MAX_CONDITION_IMAGES,
    memory_budget: PrefixMemoryBudget | None = None,
    references: ReferenceCache | None = None,
) -> Conditioning:
    """Encode one request.

    text_encoder:  a `Qwen21TextEncoder`.
    vae:           offers `encode(images [B, H, W, 4] float 0..1) -> raw latents [B, z, H/16, W/16]` (mode)
                   and `normalize(raw) -> (raw - mean) / std`.
    images, masks: condition images in slot order (see images.condition_images_to_rgba for formats).
    negative_prompt: None disables the negative branch; "" is encoded (as " ", like the reference). Only
                   tokenized here: `encode_negative` encodes it when a sampler needs it.
    output_resolution: condition images are resized to about this side length (area output_resolution^2).
    width, height: output size; derived from the last condition image's aspect ratio when left None.
    memory_budget: when given, fail before encoding if the positive branch's DiT prefix K/V would not fit
                   (the negative branch is checked by `encode_negative`, when true_cfg_scale > 1 needs it).
    references:    where condition images seen before keep their resized copies and latents (the pipeline's);
                   None prepares and encodes every image afresh.
    """
    _check_inputs(prompt, negative_prompt, output_resolution, max_images)
    rgba_images = condition_images_to_rgba(images, masks)
    if len(rgba_images) > max_images:
        raise ValueError(
            f"got {len(rgba_images)} condition images but at most {max_images} are accepted "
            f"(Qwen-Image-2.1 in this pack supports up to {MAX_CONDITION_IMAGES}); drop some images"
        )
    references = references if references is not None else ReferenceCache(max_images=0)
    prepared = [references.prepare(image, output_resolution) for image in rgba_images]
    width, height = derive_output_size([image.source_size for image in prepared], output_resolution, width, height)
    _check_pad_counts(text_encoder, prepared, output_resolution)

    pad_counts = [image.pad_tokens for image in prepared]
    prompts = {"positive": prompt} if negative_prompt is None else {"positive": prompt, "negative": negative_prompt}
    lengths = {name: text_encoder.count_tokens(text, pad_counts) for name, text in prompts.items()}
    _check_prompt_fits(lengths["positive"], [(image.width, image.height) for image in prepared])
    prefix_tokens = {name: _prefix_tokens(length, pad_counts) for name, length in lengths.items()}
    if memory_budget is not None:
        _check_prefix_memory(memory_budget, {"positive": prefix_tokens["positive"]})

    vlm_images = tuple(image.vlm for image in prepared)
    (positive,) = text_encoder.encode_prompts([prompt], vlm_images)
    vae_device = getattr(vae, "device", None)
    vae_identity = _vae_identity(vae)

    def vae_latents(image: ConditionImage) -> torch.Tensor:
        pixels = image.vae if vae_device is None else image.vae.to(vae_device)
        return vae.normalize(vae.encode(pixels))[0]  # [z, H/16, W/16]

    condition_latents = [
        references.latents(image, output_resolution, vae_identity, vae_device, lambda image=image: vae_latents(image))
        for image in prepared
    ]

    pending = None if negative_prompt is None else PendingPrompt(negative_prompt, vlm_images, lengths["negative"])
    return Conditioning(
        positive=positive,
        negative_pending=pending,
        condition_latents=tuple(condition_latents),
        width=width,
        height=height,
        content_hash=_content_hash(
            prompt, negative_prompt, prepared, width, height, output_resolution, text_encoder, vae
        ),
        extra={
            "image_sizes": [(image.width, image.height) for image in prepared],
            "source_sizes": [image.source_size for image in prepared],
            "output_resolution": output_resolution,
            "prefix_tokens": prefix_tokens,
            "vlm_images": vlm_images,  # what a negative prompt asked for later is encoded with
        },
    )


def encode_negative(text_encoder, cond: Conditioning, memory_budget: PrefixMemoryBudget | None = None) -> Conditioning:
    """Encode `cond`'s pending negative prompt into `cond.negative`, with the condition images the positive
    prompt saw; a no-op when there is none or it is already encoded. memory_budget: when given, fail before
    encoding if the prefix K/V of both branches would not fit. The content hash already covers the negative
    prompt, so it is the same before and after."""
    pending = cond.negative_pending
    if pending is None:
        return cond
    _check_prompt_fits(pending.length, [(w * LATENT_PIXELS, h * LATENT_PIXELS) for h, w in cond.image_shapes])
    if memory_budget is not None:
        pad_counts = [h * w // 4 for h, w in cond.image_shapes]
        prefix_tokens = {
            "positive": _prefix_tokens(cond.positive.length, pad_counts),
            "negative": _prefix_tokens(pending.length, pad_counts),
        }
        _check_prefix_memory(memory_budget, prefix_tokens)
    (negative,) = text_encoder.encode_prompts([pending.text], pending.vlm_images)
    cond.set_negative(negative)
    log.debug("encoded the negative prompt (%d tokens) for true CFG", negative.length)
    return cond
