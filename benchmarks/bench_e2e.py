"""End to end: the example workflows through the node classes (the in-process runner), on full-size random weights
built in memory (the DiT, the Qwen3-VL-8B text encoder, the VAE; no files), uncapped and under a VRAM cap, in bf16
and quantised; and the diffusers pipeline end to end on the same weights in the same process. The second run of a
workflow changes only the seed, and its encoder node returns the first run's conditioning, as ComfyUI's output
cache would.

    python benchmarks/bench_e2e.py                       # H200: the matrix in CONFIGS
    python benchmarks/bench_e2e.py --tiny --device cpu   # smoke test of the script itself

A cap is `torch.cuda.set_per_process_memory_fraction` (the stand-in for a smaller card) plus the same budget given
to the memory manager (`memory_adapter.set_vram_budget`, as `--vram-budget` does). Each configuration runs its
workflow twice: a first run with the weights in CPU RAM (as after a load from disk) and a second with a new seed. One
JSON line per
run: the seconds of each phase (load = the loader node, encode, sample, decode, total), peak VRAM, the sampler's
plan (K/V placement, streamed blocks) and the status lines.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import emit, random_dit, sync  # noqa: E402
from qwen21_nodes.nodes import memory_adapter  # noqa: E402
from qwen21_nodes.nodes.model import Qwen21Model  # noqa: E402
from qwen21_nodes.qwen21_core.checkpoints.loading import TEXT_ENCODER_QUANTIZES_ACTIVATIONS  # noqa: E402
from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER, TransformerConfig, VAEConfig  # noqa: E402
from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan  # noqa: E402
from qwen21_nodes.qwen21_core.memory.planner import indexed_device  # noqa: E402
from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline  # noqa: E402
from qwen21_nodes.qwen21_core.quant.linear import QuantLinear, quantize_linears_  # noqa: E402
from qwen21_nodes.qwen21_core.quant.weights import FORMATS  # noqa: E402
from qwen21_nodes.qwen21_core.text.encoder import Qwen21TextEncoder, decoder_linear_names  # noqa: E402
from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE  # noqa: E402
from qwen21_nodes.runner.cli import EXAMPLE_INPUTS, WORKFLOWS_DIR, node_classes  # noqa: E402
from qwen21_nodes.runner.graph import execute, load_prompt  # noqa: E402

GIB = 2**30
WORKFLOWS = {"t2i": "text_to_image.json", "edit4": "edit_4_references.json"}
# (precision, cap GiB or None, workflows), most needed first (a time-boxed run keeps what finished): the
# quantised baselines and the 24/16/12 GB targets, bf16 at 24 GB with 4 references, then the rest
CONFIGS = [
    ("fp8", None, ("t2i", "edit4")),
    ("fp8", 24, ("t2i", "edit4")),
    ("bf16", 24, ("edit4", "t2i")),
    ("fp8", 16, ("t2i", "edit4")),
    ("fp8", 12, ("t2i", "edit4")),
    ("int8", None, ("t2i", "edit4")),
    ("int8", 24, ("t2i", "edit4")),
    ("int8", 16, ("t2i", "edit4")),
    ("int8", 12, ("t2i", "edit4")),
    ("bf16", 16, ("t2i",)),
    ("bf16", None, ("t2i", "edit4")),
]
TINY_CONFIGS = [("bf16", None, ("t2i", "edit4")), ("fp8", None, ("t2i",))]


# ---- models built in memory -----------------------------------------------------------------------------


def build_parts(args, device, dtype):
    """(DiT, text encoder (ours), its transformers model with lm_head (for diffusers), processor, VAE), on CPU."""
    if args.tiny:
        from qwen21_nodes.qwen21_core.text.tiny import build_tiny_text_encoder
        from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER, TINY_VAE

        full, processor = build_tiny_text_encoder()
        full = full.to(dtype)
        dit = random_dit(TINY_TRANSFORMER, "cpu", dtype)
        vae = QwenImage21VAE(TINY_VAE).to(dtype).eval()
    else:
        from bench_text_encoder import build_full_size

        full, processor = build_full_size(device, dtype)
        full = full.to("cpu")
        dit = random_dit(TransformerConfig(), device, dtype).to("cpu")
        torch.manual_seed(0)
        vae = QwenImage21VAE(VAEConfig()).to(device, dtype).eval().to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dit, full, processor, vae


def quantized_parts(parts, precision, device):
    """The parts with the DiT's block Linears and the text encoder's decoder Linears in `precision` (quantised on
    the GPU, kept on the CPU; the float parts are shared, not copied)."""
    dit, full, processor, vae = parts
    if precision == "bf16":
        return dit, full.model, processor, vae
    fmt = FORMATS[precision]
    qdit = dit.to(device).quantized_copy(uniform_plan(fmt, dit.config.num_layers)).to("cpu")
    dit.to("cpu")
    text = copy.copy(full.model)  # shallow: only the quantised layers are new
    # its own child table: a shallow copy shares `_modules`, and setting language_model would replace the float
    # model's too (runs before this fix measured bf16 and int8 with the first quantised encoder)
    text._modules = dict(full.model._modules)
    text.language_model = copy.deepcopy(full.model.language_model).to(device)
    quantize_linears_(text, decoder_linear_names(text), fmt, TEXT_ENCODER_QUANTIZES_ACTIVATIONS)  # as the loader
    text.language_model.to("cpu")
    if any(isinstance(m, QuantLinear) for m in full.model.modules()):
        raise RuntimeError(f"quantising the {precision} text encoder changed the float one")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return qdit, text, processor, vae


def handle_for(parts, device, dtype, offload_text_encoder="always") -> Qwen21Model:
    """The node-level model handle; offload_text_encoder as the loader's input ("always": this benchmark's rows
    measure the encoder leaving the GPU after every encode)."""
    dit, text, processor, vae = parts
    pipe = Qwen21Pipeline(dit, vae, Qwen21TextEncoder(text, processor), QWEN21_SCHEDULER, text_encoder_offload=True)
    pipe.execution_device = device
    pipe.text_encoder.device = device
    return Qwen21Model(pipe, offload_text_encoder=offload_text_encoder, device=device)


# ---- one configuration --------------------------------------------------------------------------------


def cap_memory(device, cap_gib):
    if device.type != "cuda":
        return
    device = indexed_device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if cap_gib is None else cap_gib * GIB / total, device)
    memory_adapter.set_vram_budget(None if cap_gib is None else int(cap_gib * GIB))


def cuda_census(owners: dict, top: int = 6, device_type: str = "cuda") -> dict:
    """What holds CUDA memory now (to find a leak): the live CUDA tensors Python can see, by owner (a parameter or
    buffer of a named model part, first two name levels) or else by shape and dtype, biggest first, in GiB. Tensors
    only C++ holds (a CUDA graph's pool) are in allocated_gib but not in seen_gib."""
    names = {}
    for owner, module in owners.items():
        for name, tensor in [*module.named_parameters(remove_duplicate=False), *module.named_buffers()]:
            if tensor.device.type == device_type:
                names[tensor.untyped_storage().data_ptr()] = f"{owner}." + ".".join(name.split(".")[:2])
    groups, seen = {}, set()
    with warnings.catch_warnings():  # isinstance on some deprecated module proxies warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if _is_tensor_on(obj, device_type)]
    for obj in tensors:
        try:
            storage = obj.untyped_storage()
        except (ReferenceError, RuntimeError):  # dead proxies; tensors without storage (meta, sparse)
            continue
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        key = names.get(storage.data_ptr(), f"{tuple(obj.shape)} {obj.dtype}")
        groups[key] = groups.get(key, 0) + storage.nbytes()
    allocated = torch.cuda.memory_allocated() if device_type == "cuda" else 0
    biggest = sorted(groups.items(), key=lambda item: -item[1])[:top]
    return dict(allocated_gib=round(allocated / GIB, 2), seen_gib=round(sum(groups.values()) / GIB, 2),
                biggest={key: round(nbytes / GIB, 3) for key, nbytes in biggest})  # fmt: skip


def _is_tensor_on(obj, device_type: str) -> bool:
    try:
        return isinstance(obj, torch.Tensor) and obj.device.type == device_type
    except (ReferenceError, RuntimeError):
        return False


def model_parts(quantized: dict) -> dict:
    """Every model part built so far, named for the census."""
    owners = {}
    for precision, (dit, text, _processor, vae) in quantized.items():
        owners.update({f"{precision}.dit": dit, f"{precision}.text": text, f"{precision}.vae": vae})
    return owners


def reset(handle, device):
    """Everything back to the CPU, caches and graphs released: the next configuration starts from RAM."""
    memory_adapter.LOCAL.loaded.clear()
    if handle is not None:
        handle.pipe.release()
        handle.pipe.set_loras(())
        handle.pipe.transformer.place("cpu")
        handle.pipe.text_encoder.place("cpu")
        handle.pipe.vae.to("cpu")
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def workflow_prompt(name, handle, args, seed):
    data = json.loads((WORKFLOWS_DIR / "api" / WORKFLOWS[name]).read_text())
    prompt = load_prompt(data)
    for node in prompt.values():
        if node["class_type"] == "Qwen21Sampler":
            node["inputs"]["seed"] = seed
            if args.tiny:
                node["inputs"]["steps"] = 2
        if node["class_type"] == "Qwen21Encode" and args.tiny:
            node["inputs"]["output_resolution"] = 256
    return prompt


def classes_with(handle, output_dir, device, cached_encode=None):
    """The runner's node classes with the loader handing out the in-memory model; `cached_encode` makes the
    encoder return a first run's result, as ComfyUI's output cache does when only the seed changed."""
    classes = node_classes(str(EXAMPLE_INPUTS), output_dir)
    base = classes["Qwen21ModelLoader"]
    encode_base = classes["Qwen21Encode"]

    class CachedEncode(encode_base):
        def encode(self, **_inputs):
            return cached_encode

    class InMemoryLoader(base):
        """The loader with its file inputs ignored: it hands out the model built in memory."""

        @classmethod
        def INPUT_TYPES(cls):
            spec = base.INPUT_TYPES()
            for name in ("diffusion_model", "text_encoder", "vae"):
                spec["required"][name] = ("STRING", {"tooltip": "ignored: the model is built in memory"})
            return spec

        @classmethod
        def IS_CHANGED(cls, **_inputs):
            return "in memory"  # no files to watch: an OutputCache keeps the model from the first prompt

        def load(self, **_inputs):
            if memory_adapter.LOCAL.budget is None:  # the loader places the weights it read, as from_pretrained does
                handle.pipe.transformer.place(device)
                handle.pipe.vae.to(device)
            return (handle,)

    classes = {**classes, "Qwen21ModelLoader": InMemoryLoader}
    return classes if cached_encode is None else {**classes, "Qwen21Encode": CachedEncode}


def run_config(parts, precision, cap, names, args, device, dtype, output_dir, owners):
    reset(None, device)
    cap_memory(device, cap)
    handle = handle_for(parts, device, dtype)
    try:
        for name in names:
            classes = classes_with(handle, output_dir, device)
            for run, seed in (("first", 1), ("second", 2)):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                prompt = workflow_prompt(name, handle, args, seed)
                started = time.perf_counter()
                row = dict(what="e2e", workflow=name, precision=precision, cap_gib=cap, run=run)
                if device.type == "cuda":
                    row["allocated_before_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 2)
                try:
                    result = execute(prompt, classes)
                except Exception as error:  # noqa: BLE001 - report and go on: a failure is a result here
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                    root = error
                    while root.__cause__ is not None:
                        root = root.__cause__
                    row["root_error"] = f"{type(root).__name__}: {str(root)[:1200]}"
                    traceback.print_exception(error, file=sys.stderr)  # into the log, for where it happened
                    if device.type == "cuda":
                        row["census"] = cuda_census(owners)
                    emit(**row)
                    break
                sync(device)
                row["total_s"] = round(time.perf_counter() - started, 2)
                encode_id = next(n for n, node in prompt.items() if node["class_type"] == "Qwen21Encode")
                classes = classes_with(handle, output_dir, device, cached_encode=result.outputs[encode_id])
                for node_id, seconds in result.seconds.items():
                    phase = {"Qwen21ModelLoader": "load", "Qwen21Encode": "encode", "Qwen21Sampler": "sample",
                             "Qwen21VAEDecode": "decode"}.get(prompt[node_id]["class_type"])  # fmt: skip
                    if phase:
                        row[f"{phase}_s"] = round(row.get(f"{phase}_s", 0) + seconds, 2)
                if device.type == "cuda":
                    row["peak_vram_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
                stats = handle.pipe.last_sample_stats
                row["plan"] = stats.get("plan")
                row["kv_cache"] = stats.get("kv_cache")
                row["prefix_cache_mib"] = stats.get("prefix_cache_mib")
                row["decode_graph"] = stats.get("decode_graph")
                row["steps_per_second"] = stats.get("steps_per_second")
                row["resident_blocks"] = handle.pipe.transformer.resident_blocks
                row["text_encoder_resident_layers"] = handle.pipe.text_encoder.resident_layers
                emit(**row)
    finally:
        reset(handle, device)
        cap_memory(device, None)
        if device.type == "cuda" and torch.cuda.memory_allocated(device) > 64 * 2**20:  # something outlived its run
            emit(what="e2e_leftover", precision=precision, cap_gib=cap, **cuda_census(owners))


def diffusers_e2e(parts, args, device, dtype):
    """diffusers' QwenImage21Pipeline on the same weights: text-to-image at 1024^2, 40 steps (uncapped)."""
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )

    dit, full, processor, vae = parts
    with torch.device(device):  # built where it runs (a fast init), then given our weights
        ref_dit = QwenImage21Transformer2DModel(**dit.config.to_dict()).to(dtype)
        ref_vae = AutoencoderKLQwenImage21(**vae.config.to_dict()).to(dtype)
    ref_dit.load_state_dict({k: v for k, v in dit.checkpoint_slots().items()})
    ref_vae.load_state_dict(dict(vae.named_parameters()), strict=False)  # our names are diffusers' (no time_conv)
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN21_SCHEDULER.to_dict())
    pipe = QwenImage21Pipeline(transformer=ref_dit.eval(), vae=ref_vae.eval(), text_encoder=full.to(device),
                               processor=processor, scheduler=scheduler)  # fmt: skip
    size = 256 if args.tiny else 1024
    steps = 2 if args.tiny else 40
    for run in ("first", "second"):
        sync(device)
        started = time.perf_counter()
        pipe(prompt="a cozy reading corner by a window", height=size, width=size, num_inference_steps=steps,
             generator=torch.Generator().manual_seed(1))  # fmt: skip
        sync(device)
        row = dict(what="e2e_diffusers", workflow="t2i", run=run, total_s=round(time.perf_counter() - started, 2))
        if device.type == "cuda":
            row["peak_vram_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2)
        emit(**row)
    full.to("cpu")
    del pipe, ref_dit, ref_vae
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--only", default="", help="run only configurations like precision:cap, e.g. fp8:12,bf16:")
    parser.add_argument("--no-diffusers", action="store_true")
    parser.add_argument("--output-dir", default="/tmp/e2e_out")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("qwen21_nodes").setLevel(logging.INFO)  # the memory manager's and planner's decisions
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    parts = build_parts(args, device, dtype)
    emit(what="e2e_setup", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         torch=torch.__version__, build_s=round(time.perf_counter() - started, 1))  # fmt: skip
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if not args.no_diffusers:
        try:
            diffusers_e2e(parts, args, device, dtype)
        except Exception as error:  # noqa: BLE001 - the reference failing must not stop our rows
            emit(what="e2e_diffusers", error=f"{type(error).__name__}: {str(error)[:300]}")
    quantized = {}
    for precision, cap, names in TINY_CONFIGS if args.tiny else CONFIGS:
        label = f"{precision}:{'' if cap is None else cap}"
        if args.only and not any(label.startswith(part) for part in args.only.split(",")):
            continue
        if precision not in quantized:
            quantized[precision] = quantized_parts(parts, precision, device)
        run_config(quantized[precision], precision, cap, names, args, device, dtype, args.output_dir,
                   model_parts(quantized))  # fmt: skip


if __name__ == "__main__":
    main()
