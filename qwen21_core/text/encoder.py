"""Prompt and condition-image encoding with Qwen3-VL, the way Qwen-Image-2.1 was trained.

The VLM itself is transformers' Qwen3-VL; this module only decides what goes in and what comes out:

* the prompt is wrapped in a raw chat template (system turn, user turn with one
  `<imageN><|vision_start|><|image_pad|><|vision_end|>` block per condition image, space-separated,
  then the assistant header), tokenized by the processor together with the images;
* the DiT reads the last decoder layer's hidden state BEFORE the final RMSNorm;
* the system turn is dropped: everything before the second `<|im_start|>`, which does not depend on
  the tokenizer's vocabulary;
* `image_pad_mask` marks the `<|image_pad|>` positions (the DiT replaces them with VAE latents).

Each prompt is encoded alone (batch 1, no padding), exactly like one reference call, so positive and
negative prompts give the same tensors as diffusers' `encode_prompt`. The language-model head is never
run: only the hidden states are needed.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration, Qwen3VLModel, Qwen3VLProcessor

from ..conditioning import PromptEmbedding
from ..memory.host_copy import HostCopy
from ..memory.planner import indexed_device
from ..memory.streaming import place_with_streaming
from ..quant.linear import QuantLinear
from ..sdpa import planless_kernels

log = logging.getLogger(__name__)

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
IMAGE_SLOT = "<image{index}><|vision_start|><|image_pad|><|vision_end|>"
# the processor outputs an encode passes to the model (text/kernel_warmup.py passes the same)
ENCODE_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw")
IM_START = "<|im_start|>"
IMAGE_PAD = "<|image_pad|>"

# Peak activations of an encode, per token, in hidden-state vectors: how much the full-size encoder's peak grew per
# added condition-image token (benchmarks/bench_text_encoder.py), rounded up to leave room for the allocator's
# rounding. SYSTEM_TURN_TOKENS bounds the system turn the
# encoder runs but count_tokens leaves out (12 tokens with the Qwen tokenizer).
ACTIVATION_VECTORS_PER_TOKEN = 36
SYSTEM_TURN_TOKENS = 32
# Prompt tokens are bounded by the DiT's rotary table (dit/sequence.py ROPE_MAX_POSITION, checked from the token
# count before any model runs); this bounds the text the tokenizer reads to count them. Far above what fits: English
# takes 3 to 4 characters per token, and the test suite's 50,000-character prompt still gets the rotary message.
MAX_PROMPT_CHARS = 100_000

# The released text encoder, Qwen3-VL-8B (its config.json), written down as facts so benchmarks can
# build a full-size random-weight copy without downloading anything.
QWEN3_VL_8B_CONFIG = {
    "text_config": {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5_000_000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    },
    "vision_config": {
        "depth": 27,
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_heads": 16,
        "out_hidden_size": 4096,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "hidden_act": "gelu_pytorch_tanh",
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    },
    "image_token_id": 151655,
    "video_token_id": 151656,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "tie_word_embeddings": False,
}
# Its preprocessor_config.json: at least 256x256 and at most 4096x4096 pixels per image.
QWEN3_VL_IMAGE_PROCESSOR = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


class _Qwen3VLBaseModel(Qwen3VLModel):
    """Qwen3VLModel that loads a full (conditional-generation) checkpoint quietly: its lm_head
    (0.6 B parameters) is never used by an encoder, so it is skipped rather than reported."""

    _keys_to_ignore_on_load_unexpected = [r"^lm_head\."]


def build_prompt_text(prompt: str, num_images: int) -> str:
    """The raw template the checkpoint was trained with (not the processor's chat template)."""
    image_blocks = " ".join(IMAGE_SLOT.format(index=i) for i in range(1, num_images + 1))
    return (
        f"{IM_START}system\n{SYSTEM_PROMPT}<|im_end|>\n"
        f"{IM_START}user\n{image_blocks}{prompt}<|im_end|>\n"
        f"{IM_START}assistant\n"
    )


def _check_prompt(prompt, what: str) -> str:
    if not isinstance(prompt, str):
        raise TypeError(f"{what} must be a str, got {type(prompt).__name__}")
    if len(prompt) > MAX_PROMPT_CHARS:  # before the tokenizer spends time and memory on it
        raise ValueError(f"{what} has {len(prompt)} characters; at most {MAX_PROMPT_CHARS} are read (the DiT's "
                         "rotary table holds about 8,000 tokens, a few characters each); shorten it")  # fmt: skip
    # Qwen has no BOS token: an empty user turn would leave nothing to read, so the reference uses " ".
    return prompt or " "


@contextlib.contextmanager
def _final_norm_skipped(text_model: torch.nn.Module):
    """Make the text model's final RMSNorm return its input for the duration of the block.

    A forward hook's return value replaces the module output, so `last_hidden_state` becomes the last
    decoder layer's output on every transformers version (5.x ties hidden_states[-1] to the normed
    output, 4.x did not).
    """
    handle = text_model.norm.register_forward_hook(lambda module, args, output: args[0])
    try:
        yield
    finally:
        handle.remove()


def decoder_linear_names(model: torch.nn.Module) -> list[str]:
    """Module names of the Linears in a Qwen3-VL model's language-model decoder layers (what gets quantised)."""
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}" and "visual" not in name]  # fmt: skip


class Qwen21TextEncoder:
    """Qwen3-VL (model + processor) -> per-prompt `PromptEmbedding`s for Qwen-Image-2.1.

    model:      `Qwen3VLForConditionalGeneration` or its `Qwen3VLModel` (only the latter is kept: the
                language-model head is never used).
    processor:  the matching `Qwen3VLProcessor`.
    offload_after_encode: move the weights to `offload_device` after every `encode_prompts` call (the
                8B encoder is about 16 GiB in bf16); the next call brings them back to `device`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        processor: Qwen3VLProcessor,
        offload_after_encode: bool = False,
        offload_device: str | torch.device = "cpu",
    ):
        if isinstance(model, Qwen3VLForConditionalGeneration):
            model = model.model
        if not isinstance(model, Qwen3VLModel):
            raise TypeError(
                f"model must be a transformers Qwen3VLForConditionalGeneration or Qwen3VLModel, "
                f"got {type(model).__name__}"
            )
        if not callable(processor) or not hasattr(processor, "tokenizer") or not hasattr(processor, "image_processor"):
            raise TypeError(f"processor must be a transformers Qwen3VLProcessor, got {type(processor).__name__}")
        self.model = model.eval()
        self.processor = processor
        self.offload_after_encode = offload_after_encode
        self.offload_device = torch.device(offload_device)
        self._device = getattr(model, "language_model", model).embed_tokens.weight.device
        self._text_model = getattr(model, "language_model", model)
        if not hasattr(self._text_model, "norm"):
            raise TypeError(f"{type(model).__name__} has no final norm at .language_model.norm; not a Qwen3-VL model?")
        self.streamer = None  # set by place(): decoder layers streaming from host RAM
        self.host_copy: HostCopy | None = None  # the weights' pinned home off the GPU (memory/host_copy.py)
        self._im_start_id = self._special_token_id(IM_START)
        self._image_pad_id = self._special_token_id(IMAGE_PAD)
        self._identity: str | None = None
        # found at first use; the encoder's Linears are fixed once it is built (loaders quantise before building it)
        self._largest_weight_only: int | None = None  # elements of the biggest weight-only Linear (activation_bytes)
        self._weight_bytes: int | None = None  # all its weights' bytes, wherever they are (device_weight_bytes)

    def _special_token_id(self, token: str) -> int:
        tokenizer = self.processor.tokenizer
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"the processor's tokenizer has no {token} token; it is not a Qwen tokenizer")
        return token_id

    # -- loading ------------------------------------------------------------------------------------

    @classmethod
    def from_folder(
        cls,
        path: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.bfloat16,
        offload_after_encode: bool = False,
    ) -> Qwen21TextEncoder:
        """Load `path/text_encoder/` (safetensors) and `path/processor/` (or `path/tokenizer/`)."""
        root = Path(path)
        model_dir = root / "text_encoder"
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{model_dir / 'config.json'} not found: expected a diffusers-style folder with text_encoder/"
            )
        processor_dir = next((root / name for name in ("processor", "tokenizer") if (root / name).is_dir()), None)
        if processor_dir is None:
            raise FileNotFoundError(f"{root} has neither processor/ nor tokenizer/; the Qwen3-VL processor lives there")
        processor = Qwen3VLProcessor.from_pretrained(processor_dir, local_files_only=True)
        model = _Qwen3VLBaseModel.from_pretrained(model_dir, dtype=dtype, local_files_only=True, use_safetensors=True)
        model.to(device)
        log.info("loaded Qwen3-VL text encoder from %s (%s, %s)", model_dir, dtype, device)
        return cls(model, processor, offload_after_encode=offload_after_encode)

    # -- placement ----------------------------------------------------------------------------------

    @property
    def hidden_size(self) -> int:
        return self._text_model.config.hidden_size

    @property
    def device(self) -> torch.device:
        """Where encoding runs (the weights may sit on `offload_device` in between)."""
        return self._device

    @device.setter
    def device(self, device: str | torch.device) -> None:
        """Name where encoding runs without moving the weights (a memory manager places them). Kept with its index:
        told apart from the weights' "cuda:0", a plain "cuda" made the encode place the whole encoder over a
        streaming placement (at a 16 GB cap it ran out of memory)."""
        self._device = indexed_device(device)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def to(self, device: str | torch.device) -> Qwen21TextEncoder:
        self.place(device)
        self._device = self._text_model.embed_tokens.weight.device  # "cuda" -> "cuda:0": later checks compare equal
        return self

    def activation_bytes(self, tokens: int) -> int:
        """Device memory an encode of `tokens` tokens needs beyond the weights (the room a memory manager leaves):
        the activations, plus for quantised weight-only layers the biggest weight's dequantised copy (its fp32
        product and the bf16 result, alive together while the layer runs: torch's expression, which serves until the
        dequantisation kernel is compiled; the kernel writes the result only)."""
        element = self._text_model.embed_tokens.weight.element_size()
        if self._largest_weight_only is None:  # asked at every encode
            sizes = [m.in_features * m.out_features for m in self.model.modules()
                     if isinstance(m, QuantLinear) and not m.quantize_activations]  # fmt: skip
            self._largest_weight_only = max(sizes, default=0)
        dequantised = self._largest_weight_only
        return int(tokens) * ACTIVATION_VECTORS_PER_TOKEN * self.hidden_size * element + dequantised * (4 + element)

    def estimated_tokens(self, prompt: str, num_images: int, output_resolution: int) -> int:
        """The sequence an encode runs, before the images are resized: `count_tokens` with one <|image_pad|> token
        per 32x32 pixels of each condition image at about output_resolution^2 pixels, plus the system turn."""
        pads = [(int(output_resolution) // 32) ** 2] * int(num_images)
        return self.count_tokens(prompt, pads) + SYSTEM_TURN_TOKENS

    def place(self, device, resident_layers: int | None = None) -> None:
        """All weights on `device`, or with only `resident_layers` of the language model's decoder layers there and
        the others streaming from pinned host RAM one layer ahead (memory/streaming.py): how a budget, or
        ComfyUI's partial load, maps onto the encoder. The vision tower and the embeddings stay whole."""
        if self.host_copy is None:
            self.host_copy = HostCopy(self._text_model.layers, pin=torch.cuda.is_available())
        layers = self._text_model.layers
        self.streamer = place_with_streaming(self.model, layers, self.streamer, device, resident_layers,
                                             hooks_on=self._text_model, home=self.host_copy)  # fmt: skip

    @property
    def layer_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._text_model.layers[0].parameters())

    @property
    def num_layers(self) -> int:
        return len(self._text_model.layers)

    @property
    def resident_layers(self) -> int:
        return self.num_layers if self.streamer is None else self.streamer.resident

    def device_weight_bytes(self) -> int:
        if self._weight_bytes is None:  # asked several times per encode (the memory manager's room): walking the
            # parameters each time showed up in a traced encode, so the sum is kept
            self._weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        total = self._weight_bytes
        if self.streamer is None:
            return total
        return total - len(self.streamer.host) * self.layer_bytes + self.streamer.slot_bytes

    def offload(self) -> None:
        """Move the weights to `offload_device` and give the freed CUDA memory back."""
        if self._text_model.embed_tokens.weight.device == self.offload_device and self.streamer is None:
            return
        self.place(self.offload_device)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _weights_on_device(self) -> None:
        """Every weight on the encoding device, unless they are there already: a memory manager's placement (the
        embeddings there, decoder layers streaming) counts as there."""
        if self._text_model.embed_tokens.weight.device != self._device:
            self.place(self._device)

    @property
    def identity(self) -> str:
        """Names these weights and settings, for cache keys: config, dtype, processor and a weight fingerprint."""
        if self._identity is None:
            text_config = self._text_model.config
            # A few rows of weights that never stream and are never quantised (the embeddings, the final norm, the
            # vision tower's patch embedding) tell checkpoints apart cheaply.
            samples = (
                self._text_model.embed_tokens.weight[:2, :256],
                self._text_model.norm.weight[:256],
                self.model.visual.patch_embed.proj.weight.flatten(1)[:2, :256],
            )
            fingerprint = hashlib.sha256()
            for tensor in samples:
                fingerprint.update(tensor.detach().float().cpu().numpy().tobytes())
            self._identity = (
                f"qwen3vl:{self.dtype}:hidden={text_config.hidden_size}:layers={text_config.num_hidden_layers}"
                f":vocab={len(self.processor.tokenizer)}:pixels={self.pixel_limits()}"
                f":weights={fingerprint.hexdigest()[:16]}"
            )
        return self._identity

    # -- encoding -----------------------------------------------------------------------------------

    def image_pad_count(self, width: int, height: int) -> int:
        """How many `<|image_pad|>` tokens the processor gives an image of this size (after its own resize)."""
        image_processor = self.processor.image_processor
        patches = image_processor.get_number_of_image_patches(height, width, {})
        return patches // image_processor.merge_size**2

    def pixel_limits(self) -> tuple[int, int]:
        """(min_pixels, max_pixels) outside which the processor resizes images itself."""
        size = self.processor.image_processor.size
        return size["shortest_edge"], size["longest_edge"]

    def count_tokens(self, prompt: str, image_pad_counts: Sequence[int]) -> int:
        """Length of the embedding `encode_prompts` would return, without running the model."""
        prompt = _check_prompt(prompt, "prompt")
        ids = self.processor.tokenizer(build_prompt_text(prompt, len(image_pad_counts)))["input_ids"]
        # The template holds one <|image_pad|> per image; the processor expands each to its count.
        return len(ids) - self._drop_count(ids) - len(image_pad_counts) + sum(image_pad_counts)

    def _drop_count(self, ids: Sequence[int]) -> int:
        """Tokens before the second <|im_start|>: the system turn."""
        starts = [i for i, token_id in enumerate(ids) if token_id == self._im_start_id]
        if len(starts) < 2:
            raise ValueError("the prompt template lost its <|im_start|> markers; cannot drop the system turn")
        return starts[1]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], vlm_images: Sequence[Image.Image] = ()) -> list[PromptEmbedding]:
        """Encode each prompt together with the same condition images (RGB PIL, already resized).

        Returns one unpadded `PromptEmbedding` per prompt, on `self.device`, in `self.dtype`.
        """
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of str, got a single str; wrap it in a list")
        prompts = [_check_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        for i, image in enumerate(vlm_images):
            if not isinstance(image, Image.Image) or image.mode != "RGB":
                raise TypeError(
                    f"vlm_images[{i}] must be an RGB PIL image (alpha composited over white), got "
                    f"{type(image).__name__}{'/' + image.mode if isinstance(image, Image.Image) else ''}"
                )
        self._weights_on_device()
        try:
            return [self._encode_one(prompt, list(vlm_images)) for prompt in prompts]
        finally:
            if self.offload_after_encode:
                self.offload()

    def _encode_one(self, prompt: str, images: list[Image.Image]) -> PromptEmbedding:
        text = build_prompt_text(prompt, len(images))
        inputs = self.processor(text=[text], images=images or None, return_tensors="pt")
        ids = inputs["input_ids"][0]
        model_inputs = {name: inputs[name].to(self._device) for name in ENCODE_INPUTS if name in inputs}
        # every changed prompt is a new length: no kernel that plans each new shape (qwen21_core/sdpa.py)
        with _final_norm_skipped(self._text_model), planless_kernels():
            hidden = self.model(**model_inputs, use_cache=False).last_hidden_state[0]  # [L_full, hidden]
        start = self._drop_count(ids.tolist())
        image_pad_mask = (ids[start:] == self._image_pad_id).to(self._device)
        return PromptEmbedding(hidden[start:], image_pad_mask)
