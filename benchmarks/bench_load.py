"""Full-size DiT load time from local disk: our loader against diffusers, on the same files.

Writes a random full-size Qwen-Image-2.1 transformer (bf16, 7.1 B parameters, 14.2 GB) twice, with identical
bytes: (a) a diffusers transformer/ folder with ~5 GB shards and an index, (b) one ComfyUI single file
(`model.diffusion_model.` prefix, fused gate_up). Then every case runs in a fresh process, with the files
evicted from the page cache first ("cold", read from disk) and right after ("warm", from the page cache):

    ours:diffusers       loading.load_transformer(transformer/, device, bf16)
    ours:comfyui         loading.load_transformer(file, device, bf16)
    diffusers:diffusers  QwenImage21Transformer2DModel.from_pretrained(transformer/, torch_dtype=bf16).to(device)
    diffusers:comfyui    QwenImage21Transformer2DModel.from_single_file(file, config=..., torch_dtype=bf16).to(device)

One JSON line per run: seconds (until the weights are on the device), GB/s of checkpoint read, peak host RSS
above the process's size before the load, peak GPU memory, and a checksum of a few tensors that must agree
across all cases. A summary line gives our speed-up per layout and cache state.

    python benchmarks/bench_load.py                      # H200 (writes ~29 GB to /tmp/qwen21_bench_load)
    python benchmarks/bench_load.py --cases ours         # a subset; results.jsonl keeps earlier runs
    python benchmarks/bench_load.py --tiny --device cpu  # smoke test of the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
from _common import emit
from qwen21_nodes.qwen21_core.checkpoints import key_maps
from qwen21_nodes.qwen21_core.config import TransformerConfig
from qwen21_nodes.qwen21_core.dit.transformer import QwenImage21Transformer
from qwen21_nodes.qwen21_core.tiny import TINY_TRANSFORMER

CASES = ("ours:diffusers", "ours:comfyui", "diffusers:diffusers", "diffusers:comfyui")
SHARD_BYTES = 5 * 10**9
CHECKSUM_KEYS = ("img_in.weight", "transformer_blocks.1.attn.to_k.weight", "transformer_blocks.1.img_mlp.proj.weight")
COMFY_FILE = "qwen_image_2.1_random_bf16.safetensors"
BF16 = "BF16"


# ---- writing the random checkpoint ------------------------------------------------------------------------


def _random(name: str, shape, device) -> torch.Tensor:
    """Deterministic per name, so both layouts hold the same bytes; small values like trained weights."""
    generator = torch.Generator(device).manual_seed(zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=generator, device=device) * 0.02).to(torch.bfloat16)


def _write_safetensors(path: Path, entries: list[tuple[str, tuple[int, ...], list[str]]], shapes, device) -> None:
    """Stream a bf16 safetensors file: entries are (key, shape, diffusers names whose tensors form it, in order),
    so a fused ComfyUI tensor is written as its parts back to back and nothing is held in memory."""
    header, offset = {}, 0
    for key, shape, _ in entries:
        size = 2 * int(torch.Size(shape).numel())
        header[key] = {"dtype": BF16, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, _, parts in entries:
            for name in parts:
                f.write(memoryview(_random(name, shapes[name], device).cpu().view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def write_checkpoints(root: Path, config: TransformerConfig, device) -> dict[str, Path]:
    marker = root / "written.json"
    paths = {"diffusers": root / "diffusers" / "transformer", "comfyui": root / "comfyui" / COMFY_FILE}
    if marker.is_file() and json.loads(marker.read_text()) == config.to_dict():
        return paths
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in QwenImage21Transformer(config).checkpoint_slots().items()}
    start = time.perf_counter()

    folder = paths["diffusers"]
    folder.mkdir(parents=True, exist_ok=True)
    config_json = {"_class_name": "QwenImage21Transformer2DModel", "_diffusers_version": "0.42.1", **config.to_dict()}
    (folder / "config.json").write_text(json.dumps(config_json, indent=2))
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, names in enumerate(shards):
        shard = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(folder / shard, [(n, shapes[n], [n]) for n in names], shapes, device)
        weight_map.update(dict.fromkeys(names, shard))
    total = sum(2 * int(torch.Size(s).numel()) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))

    # ComfyUI: prefix every key, and write gate then up rows as one fused gate_up tensor.
    meta = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    fused = key_maps.dit_to_comfyui(meta)
    entries = []
    for key, tensor in fused.items():
        name = key.removeprefix(key_maps.COMFY_DIT_PREFIX)
        parts = [name]
        if name.endswith("img_mlp.gate_up.weight"):
            stem = name.removesuffix("gate_up.weight")
            parts = [stem + "gate_layer.weight", stem + "proj.weight"]
        entries.append((key, tuple(tensor.shape), parts))
    paths["comfyui"].parent.mkdir(parents=True, exist_ok=True)
    _write_safetensors(paths["comfyui"], entries, shapes, device)
    marker.write_text(json.dumps(config.to_dict()))
    (root / "results.jsonl").unlink(missing_ok=True)  # measured on the previous files
    emit(event="wrote_checkpoints", gb=round(2 * total / 1e9, 2), seconds=round(time.perf_counter() - start, 1))
    return paths


# ---- one measured load (runs in its own process) ----------------------------------------------------------


def _files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors")) if path.is_dir() else [path]


def _evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (no root needed for clean pages), so the load reads the disk."""
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _status_gib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def worker(case: str, cache: str, paths: dict[str, Path], device: torch.device) -> None:
    loader, layout = case.split(":")
    path, dtype = paths[layout], torch.bfloat16
    if device.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=device)  # CUDA context outside the timing
    if loader == "diffusers":
        from diffusers import QwenImage21Transformer2DModel  # imported outside the timing
    else:
        from qwen21_nodes.qwen21_core.checkpoints.loading import load_transformer
    files = _files(path)
    if cache == "cold":
        _evict(files)
    exact_peak = _reset_peak_rss()
    rss_before = _status_gib("VmRSS")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    start = time.perf_counter()
    if loader == "ours":
        model, _ = load_transformer(path, device, dtype)
        state = model.checkpoint_slots()
    elif layout == "diffusers":
        model = QwenImage21Transformer2DModel.from_pretrained(path, torch_dtype=dtype).to(device)
        state = model.state_dict()
    else:
        config_root = paths["diffusers"].parent
        model = QwenImage21Transformer2DModel.from_single_file(
            str(path), config=str(config_root), subfolder="transformer", torch_dtype=dtype, local_files_only=True
        ).to(device)
        state = model.state_dict()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start

    peak = _status_gib("VmHWM") if exact_peak else resource_peak_gib()
    file_bytes = sum(f.stat().st_size for f in files)
    checksum = sum(state[k].double().sum().item() for k in CHECKSUM_KEYS)
    emit(
        case=case,
        cache=cache,
        device=str(device),
        seconds=round(seconds, 3),
        read_gb_per_s=round(file_bytes / seconds / 1e9, 2),
        checkpoint_gb=round(file_bytes / 1e9, 3),
        rss_before_gib=round(rss_before or 0.0, 2),
        peak_rss_gib=round(peak or 0.0, 2),
        peak_rss_growth_gib=round((peak or 0.0) - (rss_before or 0.0), 2),
        peak_rss_exact=exact_peak,
        gpu_peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
        checksum=checksum,
        params_dtype=str(next(model.parameters()).dtype),
    )


def resource_peak_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ---- driver -----------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny config (smoke test)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", default="/tmp/qwen21_bench_load", help="where the checkpoints are written")
    parser.add_argument("--cases", default="", help="only cases containing this text (e.g. ours, comfyui)")
    parser.add_argument("--caches", default="cold,warm", help="cache states to run: cold, warm or both")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()

    device = torch.device(args.device)
    config = TINY_TRANSFORMER if args.tiny else TransformerConfig()
    root = Path(args.dir) / ("tiny" if args.tiny else "full")
    paths = {"diffusers": root / "diffusers" / "transformer", "comfyui": root / "comfyui" / COMFY_FILE}
    if args.worker:
        case, cache = args.worker.split("@")
        worker(case, cache, paths, device)
        return 0

    try:
        import accelerate  # noqa: F401  (diffusers loads differently without it)

        has_accelerate = True
    except ImportError:
        has_accelerate = False
    emit(event="config", tiny=args.tiny, device=str(device), torch=torch.__version__, accelerate=has_accelerate,
         gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None)  # fmt: skip
    write_checkpoints(root, config, device)

    # Results accumulate in results.jsonl, so the cases can run in separate invocations (each under the
    # device's 10-minute command limit) and the summary still compares them.
    results_file = root / "results.jsonl"
    results = {}
    if results_file.is_file():
        for line in results_file.read_text().splitlines():
            record = json.loads(line)
            results[(record["case"], record["cache"])] = record
    for case in (c for c in CASES if args.cases in c):
        for cache in args.caches.split(","):
            command = [sys.executable, __file__, "--worker", f"{case}@{cache}", "--device", args.device,
                       "--dir", args.dir] + (["--tiny"] if args.tiny else [])  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            if done.returncode != 0 or not lines:
                emit(case=case, cache=cache, error=done.stderr.strip().splitlines()[-3:])
                continue
            sys.stdout.write(lines[-1] + "\n")
            sys.stdout.flush()
            results[(case, cache)] = json.loads(lines[-1])
            with open(results_file, "a") as f:
                f.write(lines[-1] + "\n")

    checksums = {round(r["checksum"], 6) for r in results.values()}
    summary = {"event": "summary", "runs": len(results), "same_weights_in_every_case": len(checksums) <= 1}
    for layout in ("diffusers", "comfyui"):
        for cache in ("cold", "warm"):
            ours, theirs = results.get((f"ours:{layout}", cache)), results.get((f"diffusers:{layout}", cache))
            if ours and theirs:
                summary[f"speedup_{layout}_{cache}"] = round(theirs["seconds"] / ours["seconds"], 2)
    emit(**summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
