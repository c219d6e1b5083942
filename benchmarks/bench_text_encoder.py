"""Prompt + condition-image encoding time: our Qwen21TextEncoder against diffusers' encode_prompt.

Full size (H200): a random-weight Qwen3-VL-8B built from the real config (text_encoder.QWEN3_VL_8B_CONFIG)
in bf16, the real processor geometry (256^2..4096^2 pixels, 32 px per <|image_pad|>), a ~100-token prompt,
with 0, 1 and 4 condition images of 1024x1024. The tokenizer is the tiny offline BPE (no download), so
the prompt is built to a token count instead of a fixed text; the model's special-token ids are pointed
at that tokenizer's.

    python benchmarks/bench_text_encoder.py                       # cuda, bf16, full size
    python benchmarks/bench_text_encoder.py --tiny --device cpu   # seconds on a laptop CPU
    python benchmarks/bench_text_encoder.py --dequant             # fp8 weight-only: torch's dequant vs the kernel

One JSON line per case: tokens, our time and the reference's (median of --repeats after a warm-up),
their ratio, peak CUDA memory of each, max |ours - reference|, CPU preprocessing time; then one line
with the cost of offloading the encoder to CPU and bringing it back.

--dequant instead quantises the decoder's Linears in place (weight-only, --dequant-format, what the loader does) and
times changed-prompt encodes (a different prompt text each, same length) with the weights dequantised by torch's
expression and by the kernel (kernels/dequantize_weight.py), in one process: one line per image count with both
medians, their ratio, both peaks and whether the embeddings are identical; then one line for a single layer
(4096x12288, --tiny: 256x768) at M=128: dequant + F.linear and the dequant alone, both ways.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import mean_call_ms, sync  # noqa: E402
from PIL import Image  # noqa: E402
from qwen21_nodes.qwen21_core.images import prepare_condition_image  # noqa: E402
from qwen21_nodes.qwen21_core.text.encoder import (  # noqa: E402
    QWEN3_VL_8B_CONFIG,
    QWEN3_VL_IMAGE_PROCESSOR,
    Qwen21TextEncoder,
    build_prompt_text,
)
from qwen21_nodes.qwen21_core.text.tiny import (  # noqa: E402
    QWEN_SPECIAL_TOKENS,
    build_tiny_processor,
    build_tiny_text_encoder,
)

WORDS = "a capybara wearing a wizard hat reading a book by candlelight oil painting warm light".split()


def build_full_size(device: torch.device, dtype: torch.dtype):
    """Random-weight Qwen3-VL-8B (+ lm_head, for the reference) built directly on `device` in `dtype`."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    limits = QWEN3_VL_IMAGE_PROCESSOR["size"]
    processor = build_tiny_processor(min_pixels=limits["shortest_edge"], max_pixels=limits["longest_edge"])
    ids = {token: processor.tokenizer.convert_tokens_to_ids(token) for token in QWEN_SPECIAL_TOKENS}
    config = Qwen3VLConfig(
        **copy.deepcopy(QWEN3_VL_8B_CONFIG)
        | dict(
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
        )
    )
    # Built on the device in the target dtype, so transformers' random init runs there (seconds on a GPU)
    # and the rotary buffers are computed, not left empty.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval(), processor


def prompt_of(encoder: Qwen21TextEncoder, tokens: int) -> str:
    words = []
    while encoder.count_tokens(" ".join(words), []) < tokens:
        words.append(WORDS[len(words) % len(WORDS)])
    return " ".join(words)


def timed(fn, device: torch.device, repeats: int):
    """(median seconds, peak CUDA bytes or None, last result), after one warm-up call."""
    result = fn()
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return statistics.median(times), peak, result


def bench_case(encoder, reference, prompt: str, sources, image_size: int, device, repeats: int) -> dict:
    """Time one prompt with these condition images: resize, processor, our encoder, the reference."""
    start = time.perf_counter()
    prepared = [prepare_condition_image(image, image_size) for image in sources]
    resize_s = time.perf_counter() - start
    vlm_images = [image.vlm for image in prepared]
    text = build_prompt_text(prompt, len(vlm_images))
    processor_s, _, _ = timed(
        lambda: encoder.processor(text=[text], images=vlm_images or None, return_tensors="pt"), torch.device("cpu"), 3
    )
    ours_s, ours_peak, (ours,) = timed(lambda: encoder.encode_prompts([prompt], vlm_images), device, repeats)
    row = dict(
        case=f"{len(sources)} images",
        images=len(sources),
        image_size=image_size,
        tokens=ours.length,
        image_pad_tokens=int(ours.image_pad_mask.sum()),
        ours_s=round(ours_s, 4),
        ours_peak_gib=None if ours_peak is None else round(ours_peak / 2**30, 2),
        resize_s=round(resize_s, 4),
        processor_s=round(processor_s, 4),
    )
    if reference is not None:
        ref_s, ref_peak, (embeds, _, _) = timed(
            lambda: reference.encode_prompt(prompt, image=vlm_images or None, device=device), device, repeats
        )
        row.update(
            reference_s=round(ref_s, 4),
            reference_peak_gib=None if ref_peak is None else round(ref_peak / 2**30, 2),
            speedup=round(ref_s / ours_s, 3),
            max_abs_diff=(ours.embeds.float() - embeds[0].float()).abs().max().item(),
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny offline fixture instead of the 8B config")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--images", default="0,1,4", help="comma-separated condition-image counts")
    parser.add_argument("--image-size", type=int, default=None, help="square condition images (default 1024, tiny 64)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-reference", action="store_true", help="skip diffusers' encode_prompt")
    parser.add_argument("--formats", default="", help="also the quantised encoder in these formats, e.g. fp8,int8")
    parser.add_argument("--dequant", action="store_true",
                        help="only the weight-only encoder's dequant: torch's expression vs the kernel")  # fmt: skip
    parser.add_argument("--dequant-format", default="fp8", choices=["fp8", "int8"])
    args = parser.parse_args()

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    image_size = args.image_size or (64 if args.tiny else 1024)
    start = time.perf_counter()
    if args.tiny:
        model, processor = build_tiny_text_encoder()
        model = model.to(device=device, dtype=dtype)
    else:
        model, processor = build_full_size(device, dtype)
    build_s = time.perf_counter() - start
    encoder = Qwen21TextEncoder(model, processor)
    reference = None
    if not args.no_reference:
        from diffusers import QwenImage21Pipeline

        reference = QwenImage21Pipeline(
            scheduler=None, vae=None, text_encoder=model, processor=processor, transformer=None
        )
    prompt = prompt_of(encoder, args.prompt_tokens)
    params = sum(p.numel() for p in encoder.model.parameters())
    common = dict(tiny=args.tiny, device=str(device), dtype=args.dtype, encoder_params_b=round(params / 1e9, 3))
    print(json.dumps(dict(common, case="build", build_s=round(build_s, 2))), flush=True)
    if args.dequant:
        dequant_cases(encoder, common, image_size, device, dtype, args)
        return

    rng = np.random.default_rng(0)
    for count in (int(c) for c in args.images.split(",")):
        sources = [
            Image.fromarray(rng.integers(0, 256, (image_size, image_size, 4), dtype=np.uint8), "RGBA")
            for _ in range(count)
        ]
        row = bench_case(encoder, reference, prompt, sources, image_size, device, args.repeats)
        print(json.dumps(common | row), flush=True)

    offload_s, _, _ = timed(lambda: (encoder.offload(), encoder._weights_on_device()), device, 1)
    print(json.dumps(dict(common, case="offload+reload", offload_reload_s=round(offload_s, 3))), flush=True)

    if args.formats:
        quantized_cases(encoder, model, prompt, image_size, device, args)


def quantized_cases(encoder, model, prompt, image_size, device, args) -> None:
    """The same prompts with the language model's decoder Linears quantised (fp8 / int8), against bf16: time,
    peak memory, the encoder's weight bytes and the embeddings' PSNR against the bf16 encoder's. Each format runs
    weight-only (what the loader does, checkpoints/loading.py TEXT_ENCODER_QUANTIZES_ACTIVATIONS) and W8A8."""
    import math

    from qwen21_nodes.qwen21_core.quant.linear import quantize_linears_
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS
    from qwen21_nodes.qwen21_core.text.encoder import decoder_linear_names

    rng = np.random.default_rng(1)
    counts = [int(c) for c in args.images.split(",")]
    cases = {count: [Image.fromarray(rng.integers(0, 256, (image_size, image_size, 4), dtype=np.uint8), "RGBA")
                     for _ in range(count)] for count in counts}  # fmt: skip
    reference = {}
    for count, sources in cases.items():
        vlm = [prepare_condition_image(image, image_size).vlm for image in sources]
        reference[count] = encoder.encode_prompts([prompt], vlm)[0].embeds.float()
    original = encoder.model.language_model
    original_bytes = sum(p.numel() * p.element_size() for p in original.parameters())
    for fmt_name, w8a8 in [(f, w8a8) for f in args.formats.split(",") for w8a8 in (False, True)]:
        language_model = copy.deepcopy(original)
        encoder.model.language_model = language_model
        encoder._text_model = language_model
        quantize_linears_(encoder.model, decoder_linear_names(encoder.model), FORMATS[fmt_name], w8a8)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        weights = sum(p.numel() * p.element_size() for p in encoder.model.parameters())
        for count, sources in cases.items():
            vlm = [prepare_condition_image(image, image_size).vlm for image in sources]
            seconds, peak, (out,) = timed(lambda vlm=vlm: encoder.encode_prompts([prompt], vlm), device, args.repeats)
            want = reference[count]
            mse = (out.embeds.float() - want).pow(2).mean().item()
            psnr = math.inf if mse == 0 else 10 * math.log10(want.abs().max().item() ** 2 / mse)
            print(json.dumps(dict(case=f"{count} images", format=fmt_name, compute="w8a8" if w8a8 else "weight_only",
                                  ours_s=round(seconds, 4),
                                  ours_peak_gib=None if peak is None else round(peak / 2**30, 2),
                                  peak_without_the_bf16_copy_gib=None if peak is None
                                  else round((peak - original_bytes) / 2**30, 2),
                                  encoder_weights_gib=round(weights / 2**30, 2), embeds_psnr_vs_bf16_db=round(psnr, 2),
                                  embeds_rel_error=round(((out.embeds.float() - want).norm() / want.norm()).item(), 5),
                                  )), flush=True)  # fmt: skip
        encoder.model.language_model = original
        encoder._text_model = original
        del language_model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def prompt_variants(encoder: Qwen21TextEncoder, tokens: int, count: int) -> list[str]:
    """`count` different prompts of about `tokens` tokens each (the words rotated): every encode a changed prompt."""
    variants = []
    for shift in range(count):
        words = []
        while encoder.count_tokens(" ".join(words), []) < tokens:
            words.append(WORDS[(len(words) + shift) % len(WORDS)])
        variants.append(" ".join([str(shift), *words]))
    return variants


def dequant_cases(encoder, common: dict, image_size: int, device, dtype, args) -> None:
    """Changed-prompt encodes of the weight-only quantised encoder with torch's dequantisation and with the kernel
    (the gate forced each way, kernels/dequantize_weight.py), then one layer alone. The kernel serves only on CUDA
    (`kernel` says whether it ran); elsewhere both rows time torch's expression."""
    import torch.nn.functional as F
    from qwen21_nodes.kernels import dequantize_weight as D
    from qwen21_nodes.kernels._triton import triton_runs_on
    from qwen21_nodes.qwen21_core.quant.linear import quantize_linears_
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS, quantize_weight
    from qwen21_nodes.qwen21_core.text.encoder import decoder_linear_names

    fmt = FORMATS[args.dequant_format]
    quantize_linears_(encoder.model, decoder_linear_names(encoder.model), fmt, quantize_activations=False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    kernel = device.type == "cuda" and triton_runs_on(device)
    weights = sum(p.numel() * p.element_size() for p in encoder.model.parameters())
    common = dict(common, format=fmt.name, kernel=kernel, encoder_weights_gib=round(weights / 2**30, 2))
    prompts = prompt_variants(encoder, args.prompt_tokens, args.repeats + 1)  # the first one warms up
    rng = np.random.default_rng(2)
    for count in (int(c) for c in args.images.split(",")):
        sources = [Image.fromarray(rng.integers(0, 256, (image_size, image_size, 4), dtype=np.uint8), "RGBA")
                   for _ in range(count)]  # fmt: skip
        vlm = [prepare_condition_image(image, image_size).vlm for image in sources]
        row, embeds = {}, {}
        for name, use_kernel in (("torch", False), ("kernel", True)):
            with D.forced(device, fmt.storage, dtype, use_kernel=use_kernel):
                encoder.encode_prompts([prompts[0]], vlm)  # the kernel's compile, the allocator's first blocks
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                times = []
                for prompt in prompts[1:]:
                    sync(device)
                    start = time.perf_counter()
                    (out,) = encoder.encode_prompts([prompt], vlm)
                    sync(device)
                    times.append(time.perf_counter() - start)
                embeds[name] = out.embeds
            row[f"{name}_dequant_s"] = round(statistics.median(times), 4)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            row[f"{name}_peak_gib"] = None if peak is None else round(peak / 2**30, 2)
        print(json.dumps(dict(common, case=f"dequant {count} images", images=count, tokens=int(out.length),
                              changed_prompts=len(prompts) - 1, **row,
                              speedup=round(row["torch_dequant_s"] / row["kernel_dequant_s"], 3),
                              identical=bool(torch.equal(embeds["torch"], embeds["kernel"])))), flush=True)  # fmt: skip

    n, k = (256, 768) if args.tiny else (4096, 12288)
    gen = torch.Generator(device=device).manual_seed(0)
    q, scale = quantize_weight(torch.randn(n, k, device=device, generator=gen).to(dtype), fmt)
    x = torch.randn(128, k, device=device, generator=gen).to(dtype)
    iters = 3 if args.tiny else 50

    def per_call_ms(fn) -> float:
        return mean_call_ms(fn, device, iters)

    new = D.dequantize_weight_fast if kernel else D.dequantize_weight_reference
    layer = dict(
        torch_ms=per_call_ms(lambda: F.linear(x, D.dequantize_weight_reference(q, scale, dtype))),
        kernel_ms=per_call_ms(lambda: F.linear(x, new(q, scale, dtype))),
        torch_dequant_only_ms=per_call_ms(lambda: D.dequantize_weight_reference(q, scale, dtype)),
        kernel_dequant_only_ms=per_call_ms(lambda: new(q, scale, dtype)),
    )
    moved = q.numel() * (q.element_size() + torch.empty((), dtype=dtype).element_size())
    identical = torch.equal(new(q, scale, dtype), D.dequantize_weight_reference(q, scale, dtype))
    print(json.dumps(dict(common, case="dequant layer", shape=[n, k], rows=128,
                          **{name: round(ms, 4) for name, ms in layer.items()},
                          speedup=round(layer["torch_ms"] / layer["kernel_ms"], 3),
                          kernel_dequant_gb_s=round(moved / layer["kernel_dequant_only_ms"] / 1e6, 1),
                          identical=identical)), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
