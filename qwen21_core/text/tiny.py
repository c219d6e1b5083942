"""An offline, tiny, random-weight Qwen3-VL text encoder for tests and `make-tiny`.

Nothing here downloads anything. The tokenizer is a byte-level BPE trained in-process on a few
sentences, with Qwen's special tokens, so any prompt can be encoded (unknown words fall back to
bytes). Token ids and the length of the system turn therefore differ from the real Qwen vocabulary;
the code that drops the system turn must not depend on them (text/encoder.py finds the second
`<|im_start|>` instead).

The image processor is the real `Qwen2VLImageProcessor` with Qwen3-VL's patch geometry (16-pixel
patches, 2x2 merge: one `<|image_pad|>` per 32x32 pixels), but a small minimum pixel count so that
tiny test images are not upscaled by the processor.

`save_tiny_text_encoder(root)` writes a checkpoint folder the same way a real one is laid out:

    root/text_encoder/config.json, model.safetensors   (transformers save_pretrained, safetensors)
    root/processor/tokenizer.json, tokenizer_config.json, processor_config.json, chat_template.jinja

which `Qwen21TextEncoder.from_folder(root, ...)` and diffusers' `QwenImage21Pipeline` both read.
"""

from __future__ import annotations

from pathlib import Path

import torch

TINY_HIDDEN_SIZE = 64

# Qwen2/Qwen3 special tokens, in the order of the real vocabulary.
QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Enough text for the BPE merges to cover the template and typical test prompts; anything else is
# still encodable byte by byte.
_TRAINING_TEXT = (
    "system\nComprehend and analyze the provided prompt.",
    "user\nassistant\n",
    "A capybara wearing a wizard hat, reading a book by candlelight, oil painting.",
    "Make it blue. Replace the background with a beach at sunset. Remove the text.",
    "blurry, low quality, watermark, distorted, ugly, bad anatomy",
    "a photo of a cat and a dog on a red sofa in the living room",
    "<image1> <image2> <image3> <image4>",
)

# Minimal chat template (system/user/assistant turns, string or list-of-parts content). Only used by
# callers that go through apply_chat_template, such as diffusers when it counts the system tokens.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_processor(min_pixels: int = 32 * 32, max_pixels: int = 4096 * 4096):
    """A Qwen3VLProcessor with an in-process BPE tokenizer and Qwen3-VL's image geometry."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_TRAINING_TEXT, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768
    )
    geometry = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **geometry)
    video_processor = Qwen3VLVideoProcessor(**geometry)
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=TINY_CHAT_TEMPLATE,
    )


def tiny_text_encoder_config(tokenizer, hidden_size: int = TINY_HIDDEN_SIZE):
    """A 2-layer Qwen3-VL config; `hidden_size` is the context dim the tiny DiT reads."""
    from transformers import Qwen3VLConfig

    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    return Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=32768,
            # mrope_section covers head_dim / 2 rotary pairs (t, h, w), interleaved as in Qwen3-VL.
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [8, 4, 4],
                "mrope_interleaved": True,
            },
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=hidden_size,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            deepstack_visual_indexes=[0],
            num_position_embeddings=64,  # an 8x8 learned grid, interpolated to the image grid
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def build_tiny_text_encoder(hidden_size: int = TINY_HIDDEN_SIZE, seed: int = 0):
    """(Qwen3VLForConditionalGeneration in eval mode, Qwen3VLProcessor), same weights for the same seed."""
    from transformers import Qwen3VLForConditionalGeneration

    processor = build_tiny_processor()
    config = tiny_text_encoder_config(processor.tokenizer, hidden_size)
    # Fork the RNG so building a fixture leaves the caller's random state alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    return model.eval(), processor


def save_tiny_text_encoder(root: str | Path, hidden_size: int = TINY_HIDDEN_SIZE, seed: int = 0) -> Path:
    """Write root/text_encoder/ and root/processor/ like a real checkpoint; returns root."""
    root = Path(root)
    model, processor = build_tiny_text_encoder(hidden_size, seed)
    model.save_pretrained(root / "text_encoder", safe_serialization=True)
    processor.save_pretrained(root / "processor")
    return root


def load_tiny_text_encoder(root: str | Path, device="cpu", dtype=torch.float32):
    """Read a folder written by save_tiny_text_encoder through the normal loader path."""
    from .encoder import Qwen21TextEncoder

    return Qwen21TextEncoder.from_folder(root, device=device, dtype=dtype)
