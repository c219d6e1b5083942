"""LoRA cost and error on the full-size random DiT, with a rank-64 LoRA on every block Linear. Prints one JSON line
per measurement.

bf16 (`lora_decode_step`, `lora_bf16_latents`, `lora_switch`): the decode step without and with the LoRA merged
(eager and CUDA-graph replay; a merged LoRA must cost nothing per step), read + merge and switch times with the
originals re-read from the checkpoint file and kept as copies (MemoryOriginals: on the GPU when the memory planner
finds room, else in pinned host RAM), and a bit-exact removal check. Every switch line gives each step's phases
(`merge_phases`, `switch_strength_phases`, `switch_lora_phases`, `remove_phases`: the LoRA file's read, restoring
originals, the factors to the device, keeping copies, the file re-read with the merge in the same pass, merging from
the weights' values, the range checks) and where the copies went (`originals_on`).

fp8, int8, int8_convrot, against the bf16 model with the LoRA merged exactly (lora/merge.py says how each merge
works). First a quantised copy of the bf16 weights, as a quantised file (Comfy-Org's fp8_scaled / int8_convrot)
loads, the LoRA merged from its loaded values ("merged_from": "loaded values"):
- `lora_quant_layers`: per linear type over all blocks, the relative error of the merged requantised weight against
  the exact merged weight (loaded weight + delta), beside the format's own error on the weight without a LoRA, and
  the merged weight against bf16 + delta (the two together);
- `lora_quant_step`: the 1024^2 decode step without a LoRA, with it merged (target: <= 1.03x) and as the exact
  side path, eager and replayed; velocity PSNR against bf16 (with the merged LoRA / without a LoRA; target: the
  first no more than 1 dB below the second) and of the side path; the merge's time and peak extra VRAM; removal;
- `lora_quant_latents`: 40-step latents PSNR against bf16's: LoRA merged, no LoRA, side path;
- `lora_quant_switch` (restore_from memory): read + merge, strength change, another LoRA, removal (each <= 2 s),
  bit-exact removal, with compact copies (8-bit values and scales) of the loaded weights.
Then the bf16 checkpoint loaded as that format (a user's bf16 file with weight_dtype fp8/int8/int8_convrot), the
LoRA merged from the file's float weights ("merged_from": "file floats"): `lora_quant_layers`,
`lora_quant_file_merge` (velocity PSNR and drop, latents PSNR, merge time and peak) and `lora_quant_switch`
(restore_from file). `lora_targets`: the issue's targets per format, met or not.

    python benchmarks/bench_lora.py                      # H200: full size, 1024x1024, all formats
    python benchmarks/bench_lora.py --tiny --device cpu  # smoke test of the script itself

The random checkpoint (14.2 GB at full size) and the two LoRA files go to --dir and are deleted afterwards.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from _common import emit, sync
from bench_dit import STEPS, TINY_CONFIG, build_models, case_inputs, psnr, timed
from qwen21_nodes.qwen21_core.checkpoints.loading import load_transformer
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
from qwen21_nodes.qwen21_core.lora.merge import (
    FileOriginals,
    LoraMerger,
    MemoryOriginals,
    full_fp32_matmul,
    layer_shapes,
    lora_layers,
    parameters_of,
)
from qwen21_nodes.qwen21_core.lora.reading import read_lora
from qwen21_nodes.qwen21_core.quant.plan import WeightFormats
from qwen21_nodes.qwen21_core.quant.weights import FORMATS, dequantize_weight
from safetensors.torch import save_file

BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj",
                 "img_mlp.out")  # fmt: skip
# The tiny smoke-test model, 256 wide so that int8_convrot rotates (its groups are 256 inputs)
TINY_LORA_CONFIG = {**TINY_CONFIG, "attention_head_dim": 128, "axes_dims_rope": (16, 56, 56)}
TARGET_STEP_RATIO = 1.03
TARGET_PSNR_DROP_DB = 1.0
TARGET_SWITCH_S = 2.0


def write_lora(path: Path, model, rank: int, seed: int, layout: str = "peft") -> Path:
    """A LoRA (bf16) of `rank` on every block linear, deltas ~5% of the weights' spread. `layout` "peft": diffusers/
    PEFT names; "comfyui": the names ComfyUI saves (`diffusion_model.<layer>.lora_down/lora_up.weight`, `.alpha` =
    rank, the same scale), the only one a ComfyUI before native 2.1 maps onto our MODEL."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    shapes = layer_shapes(model)
    tensors = {}
    for i in range(model.config.num_layers):
        for linear in BLOCK_LINEARS:
            layer = f"transformer_blocks.{i}.{linear}"
            out, inp = shapes[layer]
            down = torch.randn(rank, inp, generator=gen, device=model.device) * inp**-0.5
            up = torch.randn(out, rank, generator=gen, device=model.device) * (0.05 * (3 * inp) ** -0.5)
            if layout == "comfyui":
                tensors[f"diffusion_model.{layer}.lora_down.weight"] = down.to(torch.bfloat16).cpu()
                tensors[f"diffusion_model.{layer}.lora_up.weight"] = up.to(torch.bfloat16).cpu()
                tensors[f"diffusion_model.{layer}.alpha"] = torch.tensor(float(rank))
            else:
                tensors[f"transformer.{layer}.lora_A.weight"] = down.to(torch.bfloat16).cpu()
                tensors[f"transformer.{layer}.lora_B.weight"] = up.to(torch.bfloat16).cpu()
    save_file(tensors, path)
    return path


def decode_times(model, device, iters, res, prefix: str) -> tuple[dict, torch.Tensor]:
    """Eager and graph-replay decode step at `res` (text-only prompt), in ms; the graph's velocity for checks."""
    config = model.config
    mask, embeds, cond, x, shapes, target = case_inputs(res, 0, 1, config, device, model.dtype, seed=res)
    t = torch.full((1,), 0.5, device=device, dtype=model.dtype)
    layout = build_layout(mask, shapes, target)
    out = {}
    with torch.inference_mode():
        branch = model.new_branch(layout)
        model.prefill(branch, embeds, cond)
        out[f"{prefix}_decode_eager_ms"] = round(timed(lambda: model.decode(branch, x, t), device, iters), 3)
        velocity = model.decode(branch, x, t)
        branch.release()
        if device.type == "cuda":
            graphs = DecodeGraphs(model, launch_bound_share=0)
            gbranch = graphs.new_branch(layout, 1, "auto", "positive")
            model.prefill(gbranch, embeds, cond)
            out[f"{prefix}_decode_graph_ms"] = round(timed(lambda: graphs(gbranch, x, t), device, iters), 3)
            out[f"{prefix}_graph_status"] = graphs.describe()
            velocity = graphs(gbranch, x, t)
            graphs.clear()
    return out, velocity.float()


def sampled_latents(model, device, res, steps) -> tuple[torch.Tensor, float]:
    """`steps`-step latents from one seed (the sampler, graph decode on CUDA, 1024^2 t2i) and their seconds."""
    from qwen21_nodes.qwen21_core.conditioning import Conditioning, PromptEmbedding
    from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER
    from qwen21_nodes.qwen21_core.sampler import Sampler

    mask, embeds, _, _, _, _ = case_inputs(res, 0, 1, model.config, device, model.dtype, seed=7)
    cond = Conditioning(PromptEmbedding(embeds, mask.to(device)), width=res, height=res)
    zeros = torch.zeros(model.config.in_channels)
    graphs = DecodeGraphs(model, launch_bound_share=0) if device.type == "cuda" else None
    with torch.inference_mode():
        sync(device)
        start = time.perf_counter()
        out = Sampler(model, QWEN21_SCHEDULER, zeros, zeros + 1, decode_runner=graphs).sample(
            [cond], height=res, width=res, steps=steps, seed=3
        )
        sync(device)
    if graphs is not None:
        graphs.clear()
    return out.float(), round(time.perf_counter() - start, 2)


def clock(fn, device):
    """(fn(), seconds), synchronised around the call."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, round(time.perf_counter() - start, 3)


def add_step_ratios(row: dict, without: str, with_lora: str, name: str) -> None:
    """row[f"{kind}_ratio_{name}_vs_none"] = the `with_lora` decode step over the `without` one, per kind timed."""
    for kind in ("eager", "graph"):
        if f"{without}_decode_{kind}_ms" in row:
            row[f"{kind}_ratio_{name}_vs_none"] = round(
                row[f"{with_lora}_decode_{kind}_ms"] / row[f"{without}_decode_{kind}_ms"], 3
            )


def best_ratio(row: dict, name: str) -> float:
    """The replayed step's ratio where graphs ran (what users get on a GPU), else the eager one."""
    return row.get(f"graph_ratio_{name}_vs_none", row[f"eager_ratio_{name}_vs_none"])


def snapshot(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_weights(model, saved) -> bool:
    return all(torch.equal(p, saved[n]) for n, p in model.named_parameters())


def applied(merger, stack, device) -> tuple[float, float]:
    """merger.apply(stack): (seconds, peak device memory beyond what was allocated before it, MiB)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    _, seconds = clock(lambda: merger.apply(stack), device)
    extra = (torch.cuda.max_memory_allocated(device) - before) / 2**20 if device.type == "cuda" else 0.0
    return seconds, round(extra, 1)


PHASES = ("restore_s", "lora_to_device_s", "keep_originals_s", "file_read_and_merge_s", "merge_s", "check_s")


def phases(merger, read_s: float | None = None) -> dict:
    """Where the last apply's time went (lora/merge.py LoraMerger.last_stats): the LoRA file's read (when one was
    read for it), then restoring originals, copying the LoRA factors to the device, keeping copies of originals,
    re-reading the file with the merge in the same pass, merging from the weights' values, the range checks."""
    stats = merger.last_stats
    out = {} if read_s is None else {"read_lora_s": read_s}
    out |= {phase: stats[phase] for phase in PHASES if phase in stats}
    out["originals_on"] = stats.get("originals_on")
    return out


def switches(model, originals, lora_a_path, lora_b_path, saved, device) -> dict:
    """Read + merge, strength change, another LoRA, removal: seconds each, with the originals from `originals`,
    and each one's phases (`*_phases`)."""
    merger = LoraMerger(model, originals)
    shapes = layer_shapes(model)
    out = {}
    lora_a, out["read_s"] = clock(lambda: read_lora(lora_a_path, shapes), device)
    out["merge_s"], out["merge_peak_extra_mib"] = applied(merger, [(lora_a, 1.0)], device)
    out["merge_phases"] = phases(merger, out["read_s"])
    out["load_and_merge_s"] = round(out["read_s"] + out["merge_s"], 3)
    out["original_copies_gib"] = round(originals.nbytes / 2**30, 3)  # memory held while the LoRA is merged
    out["switch_strength_s"], _ = applied(merger, [(lora_a, 0.5)], device)
    out["switch_strength_phases"] = phases(merger)
    lora_b, read_b = clock(lambda: read_lora(lora_b_path, shapes), device)
    merge_b, _ = applied(merger, [(lora_b, 1.0)], device)
    out["switch_lora_s"] = round(read_b + merge_b, 3)
    out["switch_lora_phases"] = phases(merger, read_b)
    out["remove_s"], _ = applied(merger, [], device)
    out["remove_phases"] = phases(merger)
    out["bit_identical_after_remove"] = same_weights(model, saved)
    out["weights_touched"] = merger.last_stats.get("weights_restored")
    return out


def layer_errors(bf16_model, qmodel, loaded: dict, lora, strength: float, device) -> dict:
    """Per linear type (over all blocks): the merge's error, the format's own, and both against bf16.

    For each quantised layer the LoRA touches, with its values before the merge from `loaded` (a snapshot):
    requant = |merged - (loaded + delta)| / |loaded + delta|   the merge's rounding alone,
    format  = |loaded - bf16| / |bf16|                          the format's error without a LoRA,
    total   = |merged - (bf16 + delta)| / |bf16 + delta|        the merged layer against the exact bf16 merge.
    """

    def rel(got, want):
        return ((got - want).norm() / want.norm()).item()

    pieces = defaultdict(list)
    slots = lora_layers(qmodel)
    for piece in lora.layers:
        pieces[slots[piece.layer].param].append((slots[piece.layer].rows, piece))
    found = defaultdict(lambda: defaultdict(list))
    with torch.no_grad(), full_fp32_matmul():
        for target, touching in pieces.items():
            layer_name = target.removesuffix(".qweight")
            layer = qmodel.get_submodule(layer_name)
            q, scale = (loaded[p] for p in parameters_of(target))
            before = dequantize_weight(q, scale, layer.fmt.rotation, torch.float32)
            delta = torch.zeros_like(before)
            for rows, piece in touching:
                up, down = piece.up.to(device, torch.float32), piece.down.to(device, torch.float32)
                delta[rows] += (up @ down) * (piece.scale * strength)
            merged = layer.float_weight(torch.float32)
            bf16 = bf16_model.get_submodule(layer_name).weight.float()
            path = layer_name.split(".", 2)[2]  # "attn.to_qkv", ...
            found[path]["requant"].append(rel(merged, before + delta))
            found[path]["format"].append(rel(before, bf16))
            found[path]["total"].append(rel(merged, bf16 + delta))
            del before, delta, merged
    out = {}
    for path, errors in found.items():
        row = {"blocks": len(errors["requant"])}
        for kind, values in errors.items():
            row[f"{kind}_rel_error_mean"] = round(sum(values) / len(values), 6)
            row[f"{kind}_rel_error_max"] = round(max(values), 6)
        row["requant_over_format"] = round(row["requant_rel_error_mean"] / row["format_rel_error_mean"], 3)
        row["total_over_format"] = round(row["total_rel_error_mean"] / row["format_rel_error_mean"], 3)
        out[path] = row
    return out


def velocity(model, device, res) -> torch.Tensor:
    """One eager decode step's velocity (the same inputs as decode_times)."""
    return decode_times(model, device, 1, res, "check")[1]


def from_loaded_values(fmt, model, lora_a_path, lora_b_path, bf16, args, device, res) -> dict:
    """A quantised copy of the bf16 weights (as a quantised file loads), the LoRA merged from its loaded values:
    steps, errors, latents, switches with CPU copies of the originals. Returns the targets' inputs."""
    qmodel = model.quantized_copy(uniform_plan(FORMATS[fmt], model.config.num_layers))
    loaded = snapshot(qmodel)
    lora_a = read_lora(lora_a_path, layer_shapes(qmodel))
    none_times, none_v = decode_times(qmodel, device, args.iters, res, "no_lora")
    merger = LoraMerger(qmodel, MemoryOriginals())
    merge_s, merge_extra = applied(merger, [(lora_a, 1.0)], device)
    for path, row in layer_errors(model, qmodel, loaded, lora_a, 1.0, device).items():
        emit(what="lora_quant_layers", format=fmt, merged_from="loaded values", layer=path, **row)
    merged_times, merged_v = decode_times(qmodel, device, args.iters, res, "merged")
    latents = {}
    if args.steps:
        latents["merged"] = sampled_latents(qmodel, device, res, args.steps)
    merger.apply([])
    removed_exact = same_weights(qmodel, loaded)
    merger.apply([(dataclasses.replace(lora_a, side_path=True), 1.0)])
    side_times, side_v = decode_times(qmodel, device, args.iters, res, "side_path")
    if args.steps:
        latents["side_path"] = sampled_latents(qmodel, device, res, args.steps)
    merger.apply([])
    if args.steps:
        latents["no_lora"] = sampled_latents(qmodel, device, res, args.steps)

    step = dict(what="lora_quant_step", format=fmt, res=res, rank=args.rank, merged_from="loaded values",
                **none_times, **merged_times, **side_times, merge_s=merge_s,
                merge_peak_extra_mib=merge_extra)  # fmt: skip
    add_step_ratios(step, "no_lora", "merged", "merged")
    add_step_ratios(step, "no_lora", "side_path", "side_path")
    step |= velocity_psnrs(none_v, merged_v, bf16)
    step["velocity_psnr_side_path_vs_bf16_merged_db"] = round(psnr(side_v, bf16["merged_v"]), 2)
    step["lora_changes_velocity"] = bool(not torch.equal(none_v, merged_v))
    step["bit_identical_after_remove"] = removed_exact and same_weights(qmodel, loaded)
    if device.type == "cuda":
        step["peak_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    emit(**step)
    targets = {"step_ratio": best_ratio(step, "merged"), "psnr_drop_loaded_values_db": step["velocity_psnr_drop_db"],
               "removal_bit_exact": step["bit_identical_after_remove"]}  # fmt: skip
    if args.steps:
        (with_lora, with_s), (side, side_s), (without, without_s) = (latents[k] for k in ("merged", "side_path",
                                                                                          "no_lora"))  # fmt: skip
        emit(what="lora_quant_latents", format=fmt, merged_from="loaded values", res=res, steps=args.steps,
             latents_psnr_merged_vs_bf16_merged_db=round(psnr(with_lora, bf16["merged_latents"]), 2),
             latents_psnr_no_lora_vs_bf16_no_lora_db=round(psnr(without, bf16["none_latents"]), 2),
             latents_psnr_side_path_vs_bf16_merged_db=round(psnr(side, bf16["merged_latents"]), 2),
             merged_s=with_s, side_path_s=side_s, no_lora_s=without_s)  # fmt: skip
    if args.restore in ("both", "memory"):
        row = switches(qmodel, MemoryOriginals(), lora_a_path, lora_b_path, loaded, device)
        emit(what="lora_quant_switch", format=fmt, restore_from="memory", rank=args.rank, **row)
        targets["switches"] = [row]
    return targets


def velocity_psnrs(none_v, merged_v, bf16) -> dict:
    row = {"velocity_psnr_merged_vs_bf16_merged_db": round(psnr(merged_v, bf16["merged_v"]), 2),
           "velocity_psnr_no_lora_vs_bf16_no_lora_db": round(psnr(none_v, bf16["none_v"]), 2)}  # fmt: skip
    row["velocity_psnr_drop_db"] = round(row["velocity_psnr_no_lora_vs_bf16_no_lora_db"]
                                         - row["velocity_psnr_merged_vs_bf16_merged_db"], 2)  # fmt: skip
    return row


def from_bf16_file(fmt, model, lora_a_path, lora_b_path, bf16, checkpoint, args, device, res) -> dict:
    """The bf16 checkpoint loaded as `fmt` (a user's bf16 file with weight_dtype fp8/int8/int8_convrot), the LoRA
    merged from the file's float weights: errors, velocity and latents, switches re-reading the file."""
    (qmodel, _), load_s = clock(lambda: load_transformer(checkpoint, device, torch.bfloat16,
                                                         weight_formats=WeightFormats(fmt)), device)  # fmt: skip
    loaded = snapshot(qmodel)
    lora_a = read_lora(lora_a_path, layer_shapes(qmodel))
    none_v = velocity(qmodel, device, res)
    merger = LoraMerger(qmodel, FileOriginals(checkpoint))
    merge_s, merge_extra = applied(merger, [(lora_a, 1.0)], device)
    for path, row in layer_errors(model, qmodel, loaded, lora_a, 1.0, device).items():
        emit(what="lora_quant_layers", format=fmt, merged_from="file floats", layer=path, **row)
    row = dict(what="lora_quant_file_merge", format=fmt, res=res, merged_from="file floats", model_load_s=load_s,
               merge_s=merge_s, merge_peak_extra_mib=merge_extra, **velocity_psnrs(none_v, velocity(qmodel, device,
               res), bf16))  # fmt: skip
    if args.steps:
        latents, row["merged_latents_s"] = sampled_latents(qmodel, device, res, args.steps)
        row["latents_psnr_merged_vs_bf16_merged_db"] = round(psnr(latents, bf16["merged_latents"]), 2)
    merger.apply([])
    row["bit_identical_after_remove"] = same_weights(qmodel, loaded)
    emit(**row)
    switch = switches(qmodel, FileOriginals(checkpoint), lora_a_path, lora_b_path, loaded, device)
    emit(what="lora_quant_switch", format=fmt, restore_from="file", rank=args.rank, **switch)
    return {"psnr_drop_file_floats_db": row["velocity_psnr_drop_db"], "switches": [switch],
            "removal_bit_exact": row["bit_identical_after_remove"]}  # fmt: skip


def quantized_format(fmt, model, lora_a_path, lora_b_path, bf16, checkpoint, args, device, res) -> dict:
    """Every measurement of one quantised format (see the module docstring); returns its line of targets."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    targets = from_loaded_values(fmt, model, lora_a_path, lora_b_path, bf16, args, device, res)
    switched = targets.pop("switches", [])
    if checkpoint is not None:
        if device.type == "cuda":
            torch.cuda.empty_cache()
        file = from_bf16_file(fmt, model, lora_a_path, lora_b_path, bf16, checkpoint, args, device, res)
        switched += file.pop("switches")
        targets["removal_bit_exact"] = targets["removal_bit_exact"] and file.pop("removal_bit_exact")
        targets |= file
    keys = ("load_and_merge_s", "switch_strength_s", "switch_lora_s", "remove_s")
    targets["slowest_switch_s"] = max((row[k] for row in switched for k in keys), default=None)
    targets["removal_bit_exact"] = targets["removal_bit_exact"] and all(r["bit_identical_after_remove"]
                                                                        for r in switched)  # fmt: skip
    targets["met"] = {
        "step_ratio": targets["step_ratio"] <= TARGET_STEP_RATIO,
        **{k.removesuffix("_db"): v <= TARGET_PSNR_DROP_DB for k, v in targets.items() if k.startswith("psnr_drop")},
        "switch_times": targets["slowest_switch_s"] is None or targets["slowest_switch_s"] <= TARGET_SWITCH_S,
        "removal_bit_exact": targets["removal_bit_exact"],
    }
    return {"format": fmt, **targets}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny random model (smoke test)")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--res", type=int, default=1024, help="decode-step resolution (pixels)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--steps", type=int, default=STEPS, help="sampling steps for the latents' PSNR (0: skip)")
    parser.add_argument("--restore", choices=("both", "file", "memory"), default="both")
    parser.add_argument("--formats", default="fp8,int8,int8_convrot", help="quantised formats ('' for bf16 only)")
    parser.add_argument("--dir", default=None, help="where the random checkpoint and LoRAs go (default: a temp dir)")
    args = parser.parse_args()
    device = torch.device(args.device)
    res = 64 if args.tiny else args.res
    formats = [f for f in args.formats.split(",") if f]
    work = Path(tempfile.mkdtemp(prefix="bench_lora_", dir=args.dir))
    started_bench = time.perf_counter()
    try:
        model, _ = build_models(TINY_LORA_CONFIG if args.tiny else {}, device, torch.bfloat16, with_reference=False)
        model.requires_grad_(False)
        params = sum(p.numel() for p in model.parameters())
        emit(what="lora_setup", device=str(device), params=params, rank=args.rank, res=res, formats=formats)
        saved = snapshot(model)
        lora_a = write_lora(work / "a.safetensors", model, args.rank, seed=1)
        lora_b = write_lora(work / "b.safetensors", model, args.rank, seed=2)
        emit(what="lora_files", rank=args.rank, mb_each=round(lora_a.stat().st_size / 1e6, 1))
        checkpoint = None
        if args.restore in ("both", "file"):
            checkpoint = work / "dit.safetensors"
            started = time.perf_counter()
            save_file({k: v.contiguous().cpu() for k, v in model.checkpoint_slots().items()}, checkpoint)
            emit(what="lora_checkpoint_written", gb=round(checkpoint.stat().st_size / 1e9, 2),
                 seconds=round(time.perf_counter() - started, 1))  # fmt: skip

        # bf16: the merged step, and the references the quantised formats are measured against
        base, base_v = decode_times(model, device, args.iters, res, "no_lora")
        merger = LoraMerger(model, MemoryOriginals())
        merger.apply([(read_lora(lora_a, layer_shapes(model)), 1.0)])
        merged, merged_v = decode_times(model, device, args.iters, res, "merged")
        bf16 = {"none_v": base_v, "merged_v": merged_v}
        if args.steps:
            bf16["merged_latents"], merged_s = sampled_latents(model, device, res, args.steps)
        merger.apply([])
        if args.steps:
            bf16["none_latents"], none_s = sampled_latents(model, device, res, args.steps)
            change = round(psnr(bf16["merged_latents"], bf16["none_latents"]), 2)  # what the LoRA does to them
            emit(what="lora_bf16_latents", res=res, steps=args.steps, merged_s=merged_s, no_lora_s=none_s,
                 latents_psnr_merged_vs_no_lora_db=change)  # fmt: skip
        step = dict(what="lora_decode_step", res=res, rank=args.rank, **base, **merged)
        add_step_ratios(step, "no_lora", "merged", "merged")
        step["lora_changes_velocity"] = bool(not torch.equal(base_v, merged_v))
        step["bit_identical_after_remove"] = same_weights(model, saved)
        emit(**step)
        for source in ("file", "memory"):
            if args.restore in ("both", source):
                originals = FileOriginals(checkpoint) if source == "file" else MemoryOriginals()
                emit(what="lora_switch", restore_from=source, rank=args.rank,
                     **switches(model, originals, lora_a, lora_b, saved, device))  # fmt: skip
        del saved
        if device.type == "cuda":
            torch.cuda.empty_cache()

        for fmt in formats:
            targets = quantized_format(fmt, model, lora_a, lora_b, bf16, checkpoint, args, device, res)
            emit(what="lora_targets", **targets, bench_elapsed_s=round(time.perf_counter() - started_bench, 1))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
