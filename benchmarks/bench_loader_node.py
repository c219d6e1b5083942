"""The loader node's load, what a ComfyUI user waits for before the first image after a restart.

    python benchmarks/bench_loader_node.py --comfyui-dir ~/ComfyUI         # H200: full-size files, 3 loads
    python benchmarks/bench_loader_node.py --pack-dirs . /tmp/old --rounds 3  # two packages alternating
    python benchmarks/bench_loader_node.py --tiny --device cpu             # smoke test

Each load runs in a fresh process, as after a restart: CUDA is initialised, the pack is imported, the start-up's
priming runs and is waited for (a load starts it, qwen21_core/startup/priming.py; it is left out of the load's
time, which measures the reading and placing of the weights), then the Qwen21 Model Loader's
load (`nodes/loader.py _load`) reads the files bench_comfyui_session.py writes (full size: Comfy-Org's fp8_scaled DiT
and Qwen3-VL-8B files, a bf16 VAE, ComfyUI's own Qwen tokenizer beside them, 17.25 GB; `--tiny`: the tiny set) with
weight_dtype fp8, from the page cache (the files were written or read just before). `--pack-dirs` loads with each
package folder in turn (this checkout, an older one), one process each, for `--rounds` rounds.

One JSON line per load, `loader_node`: the package, `load_s` (until the weights are on the device), `phases` (the
seconds inside the loading functions: a processor read in a thread overlaps the rest), `reads` (each component's
read: tensors, GB, seconds), the allocated GPU memory, and the main thread's top functions by cumulative time
(cProfile; from Python 3.12 on it counts the reading threads too).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import emit  # noqa: E402

HERE = Path(__file__).resolve().parent
PHASES = ("load_transformer", "load_vae", "load_qwen3vl", "load_processor", "build_empty", "load_into")
READ_LINE = re.compile(r"(.+): ([\d.]+) GB read to .* in ([\d.]+) s \(.*, (\d+) tensors\)")


class _Reads(logging.Handler):
    """The loader's "<what>: X GB read to <device> in S s (<file>, N tensors)" lines, one per component."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.rows = []

    def emit(self, record):
        found = READ_LINE.match(record.getMessage())
        if found:
            what, gb, seconds, count = found.groups()
            self.rows.append(dict(what=what, tensors=int(count), gb=float(gb), seconds=float(seconds)))


def load_once(args) -> None:
    """The child: one load in this fresh process."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.init()  # ComfyUI initialises CUDA before it imports custom nodes
    import qwen21_nodes.nodes  # noqa: F401 - the pack's import, as at ComfyUI's start
    from qwen21_nodes.nodes import loader as loader_node
    from qwen21_nodes.qwen21_core.checkpoints import files, loading
    from qwen21_nodes.qwen21_core.startup import priming as startup_priming

    priming = startup_priming.prime_torch_kernels(device)
    if priming is not None:
        priming.join()
    phases: dict[str, float] = {}

    def timed(module, name):
        original = getattr(module, name)

        def wrapper(*a, **k):
            started = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                phases[name] = round(phases.get(name, 0.0) + time.perf_counter() - started, 3)

        setattr(module, name, wrapper)

    for name in PHASES:
        timed(loading, name)
    reads = _Reads()
    logging.getLogger("qwen21_nodes").setLevel(logging.INFO)
    logging.getLogger("qwen21_nodes").addHandler(reads)
    source = json.loads(args.child)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    model = loader_node._load(source, "fp8", args.device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    profiler.disable()
    seconds = time.perf_counter() - started
    stats = pstats.Stats(profiler)
    top = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:15]  # (file, line, name) -> (.., cumtime)
    pack = Path(loading.__file__).resolve().parents[2]
    emit(what="loader_node", pack=str(pack), load_s=round(seconds, 3), phases=phases,
         reads=reads.rows, read_threads=files._READ_THREADS,
         allocated_gib=round(torch.cuda.memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
         top_cumulative=[dict(function=f"{Path(file).name}:{line}({name})", cumulative_s=round(data[3], 3))
                         for (file, line, name), data in top])  # fmt: skip
    del model


def model_source(args) -> dict[str, str]:
    """The loader's source: the full-size files (written once into --models-dir) or the tiny set."""
    models = Path(args.models_dir)
    if args.tiny:
        from qwen21_nodes.qwen21_core.tiny import make_tiny

        paths = make_tiny(models)
        return {"transformer": str(paths["transformer"]), "text_encoder": str(paths["text_encoder"]),
                "vae": str(paths["vae"]), "tokenizer": str(paths["tokenizer"])}  # fmt: skip
    import bench_comfyui_session as session

    files = session.full_size_files(models, args.device, args.comfyui_dir)
    return {"transformer": str(files["diffusion_model"]), "text_encoder": str(files["text_encoder"]),
            "vae": str(files["vae"]), "tokenizer": str(files["text_encoder"].with_suffix(""))}  # fmt: skip


def package_path(pack_dir: str, scratch: Path) -> str:
    """A PYTHONPATH entry under which `qwen21_nodes` is `pack_dir` (a checkout's root is the package)."""
    link = scratch / Path(pack_dir).resolve().name / "qwen21_nodes"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(Path(pack_dir).resolve())
    return str(link.parent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--models-dir", default="")
    parser.add_argument("--comfyui-dir", default=os.environ.get("COMFYUI_DIR", ""),
                        help="a ComfyUI checkout: its Qwen tokenizer goes beside the full-size files")  # fmt: skip
    parser.add_argument("--pack-dirs", nargs="+", default=[str(HERE.parent)], help="package folders, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        load_once(args)
        return 0
    import bench_comfyui_session as session

    args.models_dir = args.models_dir or (
        tempfile.mkdtemp(prefix="qwen21_loader_") if args.tiny else session.FULL_SIZE_DIR
    )
    source = model_source(args)
    scratch = Path(tempfile.mkdtemp(prefix="qwen21_loader_packs_"))
    failures = 0
    for _round in range(args.rounds):
        for pack_dir in args.pack_dirs:
            # No empty entry: one would make the current folder (the clone, whose kernels/ shadows PyPI's) a root.
            roots = [package_path(pack_dir, scratch), str(HERE), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(root for root in roots if root))
            command = [sys.executable, str(HERE / "bench_loader_node.py"), "--device", args.device,
                       "--child", json.dumps(source)]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
            for line in done.stdout.splitlines():
                if line.startswith("{"):
                    print(line, flush=True)
            if done.returncode != 0:
                failures += 1
                emit(what="loader_node_error", pack=pack_dir, returncode=done.returncode, stderr=done.stderr[-2000:])
    return failures


if __name__ == "__main__":
    sys.exit(main())
