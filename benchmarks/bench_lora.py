"""LoRA cost on the full-size random DiT (bf16, CUDA): the decode step without a LoRA and with a rank-64 LoRA on every
block linear merged (eager and CUDA-graph replay; a merged LoRA must cost nothing per step); the same LoRA as a
low-rank side path beside fp8 weights (the quantised weights stay untouched) against fp8 without a LoRA; and the
time to read + merge a LoRA and to switch (another LoRA, another strength, none), with the originals re-read from
the checkpoint file and kept as CPU copies. Prints one JSON line per measurement.

    python benchmarks/bench_lora.py                      # H200: full size, 1024x1024 decode, both restore sources
    python benchmarks/bench_lora.py --tiny --device cpu  # smoke test of the script itself

The random checkpoint (14.2 GB at full size) and the two LoRA files go to --dir and are deleted afterwards.
Every switch is checked: after removing the LoRAs the weights must equal the originals bit for bit.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from _common import emit, sync
from bench_dit import TINY_CONFIG, build_models, case_inputs, psnr, timed
from qwen21_nodes.qwen21_core.dit.decode_graphs import DecodeGraphs
from qwen21_nodes.qwen21_core.dit.sequence import build_layout
from qwen21_nodes.qwen21_core.dit.transformer import uniform_plan
from qwen21_nodes.qwen21_core.lora.merge import FileOriginals, LoraMerger, MemoryOriginals, layer_shapes
from qwen21_nodes.qwen21_core.lora.reading import read_lora
from qwen21_nodes.qwen21_core.quant.weights import FORMATS
from safetensors.torch import save_file

BLOCK_LINEARS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "img_mlp.gate_layer", "img_mlp.proj",
                 "img_mlp.out")  # fmt: skip


def write_lora(path: Path, model, rank: int, seed: int) -> Path:
    """A diffusers/PEFT-named LoRA (bf16) of `rank` on every block linear, deltas ~5% of the weights' spread."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    shapes = layer_shapes(model)
    tensors = {}
    for i in range(model.config.num_layers):
        for linear in BLOCK_LINEARS:
            layer = f"transformer_blocks.{i}.{linear}"
            out, inp = shapes[layer]
            down = torch.randn(rank, inp, generator=gen, device=model.device) * inp**-0.5
            up = torch.randn(out, rank, generator=gen, device=model.device) * (0.05 * (3 * inp) ** -0.5)
            tensors[f"transformer.{layer}.lora_A.weight"] = down.to(torch.bfloat16).cpu()
            tensors[f"transformer.{layer}.lora_B.weight"] = up.to(torch.bfloat16).cpu()
    save_file(tensors, path)
    return path


def decode_times(model, device, iters, res, prefix: str) -> dict:
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
            graphs = DecodeGraphs(model)
            gbranch = graphs.new_branch(layout, 1, "auto", "positive")
            model.prefill(gbranch, embeds, cond)
            out[f"{prefix}_decode_graph_ms"] = round(timed(lambda: graphs(gbranch, x, t), device, iters), 3)
            out[f"{prefix}_graph_status"] = graphs.describe()
            velocity = graphs(gbranch, x, t)
            graphs.clear()
    return out, velocity.float()


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


def side_path_step(model, lora_path, device, iters, res, merged_velocity, fmt: str) -> dict:
    """The LoRA as side paths beside `fmt` weights (a quantised copy of `model`): the decode step against the same
    weights without a LoRA, the time to read + attach it, and its velocity against the bf16 merge."""
    quantized = model.quantized_copy(uniform_plan(FORMATS[fmt], model.config.num_layers))
    base, base_v = decode_times(quantized, device, iters, res, f"{fmt}_no_lora")
    merger = LoraMerger(quantized, MemoryOriginals())
    _, attach_s = clock(lambda: merger.apply([(read_lora(lora_path, layer_shapes(quantized)), 1.0)]), device)
    side, side_v = decode_times(quantized, device, iters, res, f"{fmt}_side_path")
    merger.apply([])
    _, removed_v = decode_times(quantized, device, 2, res, f"{fmt}_removed")
    row = dict(what="lora_side_path_step", format=fmt, res=res, **base, **side, read_and_attach_s=attach_s)
    add_step_ratios(row, f"{fmt}_no_lora", f"{fmt}_side_path", "side_path")
    row["psnr_side_path_vs_bf16_merged_db"] = round(psnr(side_v, merged_velocity), 2)
    row["psnr_no_lora_vs_bf16_merged_db"] = round(psnr(base_v, merged_velocity), 2)  # what the LoRA changes
    row["removal_restores_output"] = bool(torch.equal(removed_v, base_v))
    return row  # the quantised copy goes with this frame


def same_weights(model, snapshot) -> bool:
    return all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters())


def switches(model, originals, lora_a_path, lora_b_path, snapshot, device) -> dict:
    """Read + merge, strength change, another LoRA, removal: seconds each, with the originals from `originals`."""
    merger = LoraMerger(model, originals)
    shapes = layer_shapes(model)
    out = {}
    lora_a, out["read_s"] = clock(lambda: read_lora(lora_a_path, shapes), device)
    _, out["merge_s"] = clock(lambda: merger.apply([(lora_a, 1.0)]), device)
    out["load_and_merge_s"] = round(out["read_s"] + out["merge_s"], 3)
    out["original_copies_gib"] = round(originals.nbytes / 2**30, 3)  # host memory held while the LoRA is merged
    _, out["switch_strength_s"] = clock(lambda: merger.apply([(lora_a, 0.5)]), device)
    lora_b, read_b = clock(lambda: read_lora(lora_b_path, shapes), device)
    _, merge_b = clock(lambda: merger.apply([(lora_b, 1.0)]), device)
    out["switch_lora_s"] = round(read_b + merge_b, 3)
    _, out["remove_s"] = clock(lambda: merger.apply([]), device)
    out["bit_identical_after_remove"] = same_weights(model, snapshot)
    out["weights_touched"] = merger.last_stats.get("weights_restored")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny random model (smoke test)")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--res", type=int, default=1024, help="decode-step resolution (pixels)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--restore", choices=("both", "file", "memory"), default="both")
    parser.add_argument("--side-path", default="fp8", help="quantised format for the side-path step ('' skips it)")
    parser.add_argument("--dir", default=None, help="where the random checkpoint and LoRAs go (default: a temp dir)")
    args = parser.parse_args()
    device = torch.device(args.device)
    res = 64 if args.tiny else args.res
    work = Path(tempfile.mkdtemp(prefix="bench_lora_", dir=args.dir))
    try:
        model, _ = build_models(TINY_CONFIG if args.tiny else {}, device, torch.bfloat16, with_reference=False)
        model.requires_grad_(False)
        params = sum(p.numel() for p in model.parameters())
        emit(what="lora_setup", device=str(device), params=params, rank=args.rank, res=res)
        snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
        lora_a = write_lora(work / "a.safetensors", model, args.rank, seed=1)
        lora_b = write_lora(work / "b.safetensors", model, args.rank, seed=2)
        emit(what="lora_files", rank=args.rank, mb_each=round(lora_a.stat().st_size / 1e6, 1))

        base, base_v = decode_times(model, device, args.iters, res, "no_lora")
        merger = LoraMerger(model, MemoryOriginals())
        merger.apply([(read_lora(lora_a, layer_shapes(model)), 1.0)])
        merged, merged_v = decode_times(model, device, args.iters, res, "merged")
        merger.apply([])
        step = dict(what="lora_decode_step", res=res, rank=args.rank, **base, **merged)
        add_step_ratios(step, "no_lora", "merged", "merged")
        step["lora_changes_velocity"] = bool(not torch.equal(base_v, merged_v))
        step["bit_identical_after_remove"] = same_weights(model, snapshot)
        emit(**step)
        if args.side_path:
            emit(**side_path_step(model, lora_a, device, args.iters, res, merged_v, args.side_path))
            if device.type == "cuda":
                torch.cuda.empty_cache()

        sources = ("file", "memory") if args.restore == "both" else (args.restore,)
        for source in sources:
            if source == "file":
                checkpoint = work / "dit.safetensors"
                started = time.perf_counter()
                save_file({k: v.contiguous().cpu() for k, v in model.checkpoint_slots().items()}, checkpoint)
                emit(what="lora_checkpoint_written", gb=round(checkpoint.stat().st_size / 1e9, 2),
                     seconds=round(time.perf_counter() - started, 1))  # fmt: skip
                originals = FileOriginals(checkpoint)
            else:
                originals = MemoryOriginals()
            emit(what="lora_switch", restore_from=source, rank=args.rank,
                 **switches(model, originals, lora_a, lora_b, snapshot, device))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
