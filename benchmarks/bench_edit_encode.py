"""An edit's encode with a changed prompt and the same references: the reference cache against encoding every image
afresh, in one process, alternating (qwen21_core/reference_cache.py).

    python benchmarks/bench_edit_encode.py                       # H200: fp8 Qwen3-VL-8B + the full-size VAE, 1024^2
    python benchmarks/bench_edit_encode.py --tiny --device cpu   # smoke test of the script itself

One `edit_encode` line per reference count: the median encode with the cache (after a first prompt filled it)
and without it (`references=None`: every reference resized, hashed and VAE-encoded, as before the cache; its
content hash reads a 4 MB source digest where the old code hashed the 16 MB float copy), each prompt through both
(`identical`: the same latents and content hash), their ratio, the peak VRAM, and the host's time per reference
(digest, resize and copies, the float copy the VAE reads). Before them, `edit_first_call`: the first edit's parts
(processor, the vision tower's patch embedding, the whole vision tower, the encoder with an image, the VAE encoder at
that size), in that order, each first call against its second, after the warm-up's jobs (--image-warmup off leaves
out its image-encode job). What that job removes is paid once per machine, not per process or driver cache (a new
CUDA_CACHE_PATH does not bring it back): compare the two as the first process on two fresh machines.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _common import emit, sync  # noqa: E402
from PIL import Image  # noqa: E402

WORDS = "make the sky stormy, add a red kite, keep the cat, paint it in watercolour, golden hour light".split()


def build(args, device, dtype):
    from qwen21_nodes.qwen21_core.checkpoints.loading import TEXT_ENCODER_QUANTIZES_ACTIVATIONS
    from qwen21_nodes.qwen21_core.config import VAEConfig
    from qwen21_nodes.qwen21_core.quant.linear import quantize_linears_
    from qwen21_nodes.qwen21_core.quant.weights import FORMATS
    from qwen21_nodes.qwen21_core.text.encoder import Qwen21TextEncoder, decoder_linear_names
    from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE

    if args.tiny:
        from qwen21_nodes.qwen21_core.text.tiny import build_tiny_text_encoder
        from qwen21_nodes.qwen21_core.tiny import TINY_VAE

        model, processor = build_tiny_text_encoder(seed=0)
        vae = QwenImage21VAE(TINY_VAE)
    else:
        from bench_text_encoder import build_full_size

        full, processor = build_full_size(device, dtype)
        model = full
        quantize_linears_(model.model, decoder_linear_names(model.model), FORMATS["fp8"],
                          TEXT_ENCODER_QUANTIZES_ACTIVATIONS)  # fmt: skip
        torch.manual_seed(0)
        vae = QwenImage21VAE(VAEConfig())
    encoder = Qwen21TextEncoder(model.to(device, dtype), processor)
    return encoder, vae.to(device, dtype).eval()


def sources(count: int, size: tuple[int, int], seed: int) -> list[Image.Image]:
    """Smooth random pictures (a photo's resize costs what noise's does; a digest reads every byte either way)."""
    rng = np.random.default_rng(seed)
    width, height = size
    images = []
    for _ in range(count):
        low = rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 4), dtype=np.uint8)
        image = Image.fromarray(low, "RGBA").resize((width, height), Image.Resampling.BILINEAR)
        images.append(image)
    return images


def host_parts(images, resolution: int) -> dict:
    from qwen21_nodes.qwen21_core.images import prepare_condition_image, source_digest

    parts = {"digest_ms": [], "prepare_ms": [], "float_copy_ms": []}
    for image in images:
        start = time.perf_counter()
        digest = source_digest(image)
        parts["digest_ms"].append(time.perf_counter() - start)
        start = time.perf_counter()
        prepared = prepare_condition_image(image, resolution, digest=digest)
        parts["prepare_ms"].append(time.perf_counter() - start)
        start = time.perf_counter()
        prepared.vae  # noqa: B018 - the float copy the VAE reads
        parts["float_copy_ms"].append(time.perf_counter() - start)
    return {name: round(1000 * statistics.median(values), 2) for name, values in parts.items()}


def top_host_ops(profile, count: int = 12) -> list:
    """[op, self CPU ms, calls] of the ops that held the host longest (a first launch's module load and any PTX
    compile happen there)."""
    rows = sorted(profile.key_averages(), key=lambda row: row.self_cpu_time_total, reverse=True)[:count]
    return [[row.key, round(row.self_cpu_time_total / 1000, 2), row.count] for row in rows]


def first_edit(encoder, vae, device, resolution: int, source_size, profile: bool = False,
               image_warmup: bool = True) -> dict:  # fmt: skip
    """The first edit in a process that has encoded text only (as in a session): each part's first call against its
    second, after the kernel warm-up's text and VAE jobs ran (as a session's background warm-up does; the text part's
    image-encode job only with `image_warmup`, its time in `image_warmup_s`)."""
    from qwen21_nodes.qwen21_core.images import prepare_condition_image
    from qwen21_nodes.qwen21_core.quant.kernel_warmup import dequantize_warmup_jobs
    from qwen21_nodes.qwen21_core.sdpa import planless_kernels
    from qwen21_nodes.qwen21_core.text.encoder import build_prompt_text
    from qwen21_nodes.qwen21_core.text.kernel_warmup import image_encode_warmup_jobs
    from qwen21_nodes.qwen21_core.vae.kernel_warmup import vae_warmup_jobs

    out = {}
    if device.type == "cuda":
        for job in dequantize_warmup_jobs([(encoder.model, device)]) + vae_warmup_jobs(vae, device):
            job()
        if image_warmup:
            started = time.perf_counter()
            for job in image_encode_warmup_jobs(encoder, device):
                job()
            sync(device)
            out["image_warmup_s"] = round(time.perf_counter() - started, 4)
    image = prepare_condition_image(sources(1, source_size, seed=99)[0], resolution)

    def part(name: str, fn):
        """Time `fn()` under `name` (its first call and its second); returns what it returned."""
        first = name not in out
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        sync(device)
        start = time.perf_counter()
        with torch.no_grad(), profiler if profile and first else contextlib.nullcontext():
            result = fn()
        sync(device)
        out.setdefault(name, []).append(round(time.perf_counter() - start, 4))
        if profile and first:  # (the profiler's own cost is in this first time)
            out.setdefault("first_call_host_ops", {})[name] = top_host_ops(profiler)
        return result

    for take in range(2):  # the text-only prompts a session begins with; the second is what an image adds to
        part("text_only_s", lambda take=take: encoder.encode_prompts([f"make it stormy {take + 2}"]))
    visual = encoder.model.visual
    for take in range(2):  # [first, second] per part
        text = build_prompt_text(f"make it stormy, take {take}", 1)
        inputs = part(
            "processor_s", lambda text=text: encoder.processor(text=[text], images=[image.vlm], return_tensors="pt")
        )
        # the vision tower alone, its patch embedding (a Conv3d) first: where an image prompt's first-use costs are
        # (BENCHMARKS "Session": on a fresh machine most were in transformers' int64 prod after the tower)
        pixels = inputs["pixel_values"].to(device, encoder.dtype)
        grid = inputs["image_grid_thw"].to(device)
        part("patch_embed_s", lambda pixels=pixels: visual.patch_embed(pixels))
        with planless_kernels():  # as the encoder runs it (qwen21_core/sdpa.py)
            part("vision_tower_s", lambda pixels=pixels, grid=grid: visual(pixels, grid_thw=grid))
        part("encode_prompts_s", lambda take=take: encoder.encode_prompts([f"make it stormy {take}"], [image.vlm]))
        part("vae_encode_s", lambda: vae.encode(image.vae.to(device), tiling="off"))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--references", default="1,4")
    parser.add_argument("--image-warmup", default="on", choices=("on", "off"),
                        help="run the image-encode warm-up job (text/kernel_warmup.py) first")  # fmt: skip
    parser.add_argument("--profile-first", action="store_true",
                        help="edit_first_call also names the ops holding the host longest in first calls")  # fmt: skip
    args = parser.parse_args()
    from qwen21_nodes.qwen21_core.encoding import encode_conditioning
    from qwen21_nodes.qwen21_core.reference_cache import ReferenceCache

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    resolution, source_size = (128, (150, 110)) if args.tiny else (1024, (1200, 900))
    encoder, vae = build(args, device, dtype)
    first = first_edit(encoder, vae, device, resolution, source_size, args.profile_first, args.image_warmup == "on")
    emit(what="edit_first_call", resolution=resolution, **first)
    for count in [int(c) for c in args.references.split(",")]:
        images = sources(count, source_size, seed=count)
        cache = ReferenceCache()
        times = {"cached": [], "afresh": []}
        identical = True  # both paths give the same latents and content hash for the same prompt

        def encode(prompt: str, references, images=images):
            sync(device)
            start = time.perf_counter()
            with torch.no_grad():
                cond = encode_conditioning(encoder, vae, prompt, images, output_resolution=resolution,
                                           references=references)  # fmt: skip
            sync(device)
            return time.perf_counter() - start, cond

        encode("a first prompt fills the cache", cache)
        encode("a first prompt without it", None)  # both paths' first-call costs paid
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for repeat in range(args.repeats):
            prompt = " ".join(WORDS[: 4 + repeat]) + f", take {repeat}"
            conds = {}
            for name, references in (("cached", cache), ("afresh", None)):
                seconds, conds[name] = encode(prompt, references)
                times[name].append(seconds)
            identical = (
                identical
                and conds["cached"].content_hash == conds["afresh"].content_hash
                and all(
                    torch.equal(a, b)
                    for a, b in zip(conds["cached"].condition_latents, conds["afresh"].condition_latents, strict=True)
                )
            )
        cached, afresh = (statistics.median(times[name]) for name in ("cached", "afresh"))
        emit(what="edit_encode", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             references=count, resolution=resolution, source_size=list(source_size), repeats=args.repeats,
             cached_s=round(cached, 4), afresh_s=round(afresh, 4), afresh_over_cached=round(afresh / cached, 3),
             cached_range_s=[round(min(times["cached"]), 4), round(max(times["cached"]), 4)],
             afresh_range_s=[round(min(times["afresh"]), 4), round(max(times["afresh"]), 4)],
             identical=identical, cache_hits=cache.hits, cache_misses=cache.misses,
             peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
             host_per_reference=host_parts(images, resolution))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
