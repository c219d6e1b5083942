"""The session of bench_session.py once through a real ComfyUI server, over its HTTP API, as a user's client sees it.

    COMFYUI_DIR=... COMFYUI_PYTHON=... python benchmarks/bench_comfyui_session.py             # H200, full size, fp8
    ... python benchmarks/bench_comfyui_session.py --extra-args=--disable-cuda-malloc         # compare a flag
    ... python benchmarks/bench_comfyui_session.py --tiny --device cpu --tail 1              # smoke test
    ... python benchmarks/bench_comfyui_session.py --limit 3 --pack-dir /tmp/old             # a restart's first images
    ... python benchmarks/bench_comfyui_session.py --samplers qwen21,ksampler                # KSampler on our MODEL
    ... python benchmarks/bench_comfyui_session.py --samplers ksampler --caps none,24,16,12 --cfgs 1,4 --limit 12
    ... python benchmarks/bench_comfyui_session.py --samplers qwen21,ksampler --caps none,16 --control   # Fun-Control

bench_session.py measures the session through our node classes in one process; this one starts ComfyUI (its
default flags on the GPU, so its default cudaMallocAsync allocator and its memory manager are in the measurement;
`--cpu` with `--device cpu`) and queues the same prompts (bench_session's `plan` and `session_prompt`) one at a time
over POST /prompt, the loader pointed at model files on disk as a user has them:
- `--tiny`: the tiny checkpoint set (`make_tiny`), the DiT and text encoder quantised to fp8 while loading;
- full size: random-weight files written once into `--models-dir` (reused when its written.json is there): the DiT
  as Comfy-Org's fp8_scaled file (every block Linear float8_e4m3fn with a per-tensor scale and its comfy_quant
  marker, the rest bf16), the Qwen3-VL-8B text encoder as an fp8_scaled file too (its language model's Linears fp8,
  the vision tower and embeddings bf16, no lm_head: the loader drops it anyway) with ComfyUI's own Qwen tokenizer
  beside it, the VAE in bf16 (ComfyUI layout) and a rank-64 LoRA on every block Linear (bench_lora's, in the key
  names ComfyUI saves: KSampler's path loads it through LoraLoaderModelOnly).
`--control`: every text-to-image prompt runs with Fun-Control (Qwen21 Load Fun Control at fp8, the example's edge image,
strength 1 over the whole schedule; Qwen21 Apply Fun Control before Qwen21 Sampler, Qwen21 Apply Fun Control (MODEL)
before KSampler); the edits stay plain. Full size: a random 16-block branch in bf16 with ComfyUI's repack metadata
(CONTROL_FILE, written once beside the others); tiny: make_tiny's.
ComfyUI caches node outputs between prompts, so the loader runs once and the seed-only rerun reuses the encoder's
output. Each prompt is timed from the POST to the websocket's execution_success (or error); a phase (encode_s,
sample_s, decode_s, save_s, loader_s, lora_s) is the time from its node's `executing` message to the next node's, so it
includes what ComfyUI does around the node (its memory manager loading or unloading models), and other_s sums the
rest (LoadImage); save_s is Qwen21 Save Image's, or Save Image's for a pack without it (`--save-node`);
`sample_inner_s` is the sampler's own time from its `ui` stats. `cached` lists the nodes ComfyUI took from its
cache. Memory after a prompt comes from /system_stats: `allocated_after_gib` is torch's active bytes,
`reserved_after_gib` what its allocator holds. `memory_log` has the server log's model-placement lines of that
prompt.

Cards smaller than the GPU (`--caps`, GiB; "none" for the whole card): ComfyUI is told the card's size less the cap
with `--reserve-vram`, and the server process gets a hard cap (`torch.cuda.set_per_process_memory_fraction`, set by a
one-file custom node the benchmark puts beside the pack, which also answers GET /qwen21_bench/peak with the largest
allocation since the last ask), so that an overshoot is an out-of-memory error, not a silent success. Each cap is a
server of its own. `--cfgs 1,4` runs the prompts once per guidance scale in the same server (above 1 with the
`--negative` prompt), each with its own summary; every prompt's text is new.

Output, one JSON line each, streamed: `session_models` (files written or reused, seconds: setup, not the session),
`session_setup`, `session_prompt` per prompt and one `session_summary` (bench_session's `summary`), each with
"via": "comfyui" and the ComfyUI flags. The server's log goes to --log-dir. Needs `websocket-client`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _common import emit  # noqa: E402
from bench_session import NODE_PHASES, SAVE_NODES, plan, session_prompt, summary  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GIB = 2**30
PRECISION = "fp8"
PACK_FOLDER = "qwen21-nodes"
# full size: file names in --models-dir, by the loader input (or folder) that takes them
FULL_SIZE_FILES = {
    "diffusion_model": "diffusion_models/qwen_image_2.1_random_fp8_scaled.safetensors",
    "text_encoder": "text_encoders/qwen3vl_8b_random_fp8_scaled.safetensors",
    "vae": "vae/qwen_image_2.1_vae_random_bf16.safetensors",
    "lora": "loras/session_lora_rank64_comfyui.safetensors",
}
LORA_RANK = 64
# --dit q4_k_m: the DiT as a GGUF file (written once beside the others), loaded with weight_dtype auto
GGUF_DIT_FILE = "diffusion_models/qwen_image_2.1_random_Q4_K_M.gguf"
DITS = ("fp8", "q4_k_m")
CONTROL_FILE = "model_patches/qwen_image_2.1_fun_control_random_bf16.safetensors"
CONTROL_BLOCKS = 16
CONTROL_IMAGE = "control_edges.png"  # workflows/input, copied into the server's input/
FULL_SIZE_DIR = "/tmp/qwen21_session_models"
# server log lines that say where ComfyUI's memory manager and our loader put the models
MEMORY_LINE = re.compile(r"Requested to load|loaded completely|loaded partially|[Uu]nload|qwen21: ")
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.uint8: "U8"}


# ---- model files ---------------------------------------------------------------------------------------------


def fp8_scaled(tensors: dict, quantized) -> tuple[list, object]:
    """A ComfyUI fp8_scaled layout of `tensors` (name -> tensor, on any device): each 2-D `.weight` whose name
    `quantized(name)` accepts as float8_e4m3fn with a per-tensor fp32 `.weight_scale` and a `.comfy_quant` marker,
    the rest bf16. -> (header entries (name, dtype, shape), a generator of the tensors in that order), so a writer
    quantises one tensor at a time where it lies."""
    from quant_files import marker, quantize_fp8  # tests/: the formats as Comfy-Org's files store them

    conf = marker({"format": "float8_e4m3fn"})

    def is_quantized(name, tensor):
        return name.endswith(".weight") and tensor.dim() == 2 and quantized(name)

    header = []
    for name, tensor in tensors.items():
        if is_quantized(name, tensor):
            layer = name.removesuffix(".weight")
            header += [(name, torch.float8_e4m3fn, tuple(tensor.shape)), (f"{layer}.weight_scale", torch.float32, ()),
                       (f"{layer}.comfy_quant", torch.uint8, tuple(conf.shape))]  # fmt: skip
        else:
            header.append((name, torch.bfloat16, tuple(tensor.shape)))

    def values():
        for name, tensor in tensors.items():
            if is_quantized(name, tensor):
                q, scale, _conf = quantize_fp8(tensor)
                yield from (q, scale.float(), conf)
            else:
                yield tensor.to(torch.bfloat16)

    return header, values()


def write_safetensors(path: Path, header: list, values, metadata: dict | None = None) -> None:
    """Stream a safetensors file, one tensor at a time to the host (a .part file renamed when complete), with
    `metadata` added to the header's."""
    entries, offset = {}, 0
    for name, dtype, shape in header:
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}  # fmt: skip
        offset += size
    entries["__metadata__"] = {"format": "pt", **(metadata or {})}
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for (name, dtype, shape), value in zip(header, values, strict=True):
            if value.dtype != dtype or tuple(value.shape) != shape:
                raise ValueError(f"{name}: made {value.dtype} {tuple(value.shape)}, the header says {dtype} {shape}")
            f.write(memoryview(value.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()))
        f.flush()
        os.fsync(f.fileno())
    part.rename(path)


def write_dit(path: Path, dit) -> None:
    """Our DiT as Comfy-Org's fp8_scaled single file: ComfyUI's key layout, every block Linear fp8."""
    from qwen21_nodes.qwen21_core.checkpoints import key_maps

    comfy = key_maps.dit_to_comfyui({name: tensor.detach() for name, tensor in dit.checkpoint_slots().items()})
    write_safetensors(path, *fp8_scaled(comfy, lambda name: ".transformer_blocks." in name))


# A Q4_K_M-like mix, as llama.cpp's Q4_K_M keeps its value and down projections in Q6_K in part of the layers
GGUF_HIGHER = ("attn.to_v.weight", "img_mlp.out.weight")


def write_gguf_dit(path: Path, dit) -> None:
    """Our DiT as a Q4_K_M GGUF file in ComfyUI-GGUF's layout (bare ComfyUI names): every block Linear Q4_K, its
    to_v and MLP out in Q6_K in every other block (rows too short for 256-value blocks: Q8_0, as the converters
    fall back), vectors in F32 and the other matrices in BF16. The blocks are
    random codes with the spread of the random init (bench_gguf.random_gguf_rows), streamed one tensor at a time
    to the file (a .part file renamed when complete)."""
    import gguf
    import numpy as np
    from bench_gguf import random_gguf_rows
    from qwen21_nodes.qwen21_core.checkpoints import key_maps

    tensors = key_maps.dit_to_comfyui({n: t.detach() for n, t in dit.checkpoint_slots().items()}, prefix="")
    gen = torch.Generator(device=dit.device).manual_seed(2)
    plan = {}
    for name, tensor in tensors.items():
        if tensor.dim() == 1:
            plan[name] = "F32"
        elif name.startswith("transformer_blocks.") and tensor.dim() == 2:
            index = int(name.split(".")[1])
            qtype = "Q6_K" if name.endswith(GGUF_HIGHER) and index % 2 == 0 else "Q4_K"
            plan[name] = qtype if tensor.shape[1] % 256 == 0 else "Q8_0" if tensor.shape[1] % 32 == 0 else "BF16"
        else:
            plan[name] = "BF16"

    def data(name):
        tensor, qtype = tensors[name], plan[name]
        if qtype == "F32":
            return tensor.float().cpu().numpy()
        if qtype == "BF16":
            return tensor.to(torch.bfloat16).contiguous().view(torch.uint8).cpu().numpy()
        rows, columns = tensor.shape
        return random_gguf_rows(qtype, rows, columns, (3 * columns) ** -0.5, tensor.device, gen).cpu().numpy()

    def nbytes(name):
        from qwen21_nodes.kernels.dequantize_gguf import row_bytes

        tensor, qtype = tensors[name], plan[name]
        return tensor.numel() * 4 if qtype == "F32" else tensor.shape[0] * row_bytes(qtype, tensor.shape[-1])

    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    writer = gguf.GGUFWriter(str(part), "qwen_image21")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    for name, tensor in tensors.items():
        qtype = plan[name]
        if qtype == "F32":
            writer.add_tensor_info(name, tuple(tensor.shape), np.dtype(np.float32), nbytes(name))
        else:
            shape = (tensor.shape[0], nbytes(name) // tensor.shape[0])
            writer.add_tensor_info(name, shape, np.dtype(np.uint8), nbytes(name),
                                   raw_dtype=getattr(gguf.GGMLQuantizationType, qtype))  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name in tensors:
        writer.write_tensor_data(data(name))
    writer.close()
    part.rename(path)


def write_text_encoder(path: Path, model) -> None:
    """A transformers Qwen3-VL model as Comfy-Org's fp8_scaled file: its language model's Linears fp8, the vision
    tower and the embeddings bf16, without the lm_head (our loader reads past it)."""
    weights = {name: t for name, t in model.state_dict().items() if name != "lm_head.weight"}
    write_safetensors(path, *fp8_scaled(weights, lambda name: name.startswith("model.language_model.layers.")))


def write_vae(path: Path, vae) -> None:
    """Our VAE in bf16, ComfyUI (Wan 2.2) layout, with the temporal keys the loader reads past (random)."""
    from qwen21_nodes.qwen21_core.checkpoints import key_maps

    dropped = vae.dropped_checkpoint_keys()
    device = next(vae.parameters()).device
    weights = {name: t.detach() if t is not None else 0.02 * torch.randn(dropped[name], device=device)
               for name, t in vae.checkpoint_slots().items()}  # fmt: skip
    write_safetensors(path, *fp8_scaled(key_maps.vae_to_comfyui(weights, vae.config.num_res_blocks), lambda _: False))


def write_full_size(models: Path, device: torch.device, comfyui_dir: Path) -> None:
    """The full-size random-weight files (FULL_SIZE_FILES), each model built where it is made fast (the GPU) and
    freed before the next. Runs in a child process, so the benchmark's own process never holds GPU memory."""
    from _common import random_dit
    from bench_lora import write_lora
    from bench_text_encoder import build_full_size
    from qwen21_nodes.qwen21_core.checkpoints.loading import COMFYUI_TOKENIZER_DIR
    from qwen21_nodes.qwen21_core.config import TransformerConfig, VAEConfig
    from qwen21_nodes.qwen21_core.vae.model import QwenImage21VAE

    started = time.perf_counter()
    paths = {role: models / name for role, name in FULL_SIZE_FILES.items()}
    with torch.no_grad():
        dit = random_dit(TransformerConfig(), device, torch.bfloat16)
        paths["lora"].parent.mkdir(parents=True, exist_ok=True)
        write_lora(paths["lora"], dit, LORA_RANK, seed=3, layout="comfyui")  # KSampler's LoRA loader reads it too
        write_dit(paths["diffusion_model"], dit)
        del dit
        _free(device)
        text, _processor = build_full_size(device, torch.bfloat16)
        write_text_encoder(paths["text_encoder"], text)
        del text
        _free(device)
        tokenizer = paths["text_encoder"].with_suffix("")  # the loader looks for a folder named after the file
        if not tokenizer.is_dir():
            shutil.copytree(comfyui_dir / COMFYUI_TOKENIZER_DIR, tokenizer)  # ComfyUI's own
        torch.manual_seed(0)
        write_vae(paths["vae"], QwenImage21VAE(VAEConfig()).to(device, torch.bfloat16))
    sizes = {role: round(path.stat().st_size / 1e9, 2) for role, path in paths.items()}
    (models / "written.json").write_text(json.dumps(FULL_SIZE_FILES))
    emit(what="session_models", written=True, gb=sizes, seconds=round(time.perf_counter() - started, 1))


def write_control(path: Path, device: torch.device) -> None:
    """A full-size random Fun-Control branch (CONTROL_BLOCKS blocks) as the released file names it, in bf16, with the
    header metadata of ComfyUI's repack."""
    from _common import random_weights
    from qwen21_nodes.qwen21_core.config import TransformerConfig
    from qwen21_nodes.qwen21_core.dit.control import FunControlNet
    from qwen21_nodes.qwen21_core.tiny import CONTROL_METADATA

    started = time.perf_counter()
    with torch.no_grad():
        with torch.device("meta"):
            net = FunControlNet(TransformerConfig(), CONTROL_BLOCKS).to(torch.bfloat16)
        net = random_weights(net, device, seed=5)
        header, values = fp8_scaled({name: t.detach() for name, t in net.checkpoint_slots().items()}, lambda _: False)
        write_safetensors(path, header, values, CONTROL_METADATA)
    emit(what="session_models", written=True, gb={"control": round(path.stat().st_size / 1e9, 2)},
         seconds=round(time.perf_counter() - started, 1))  # fmt: skip


def write_full_size_gguf(path: Path, device: torch.device) -> None:
    """GGUF_DIT_FILE: the full-size DiT as a Q4_K_M GGUF (write_gguf_dit), built on `device` in a child process."""
    from _common import random_dit
    from qwen21_nodes.qwen21_core.config import TransformerConfig

    started = time.perf_counter()
    with torch.no_grad():
        write_gguf_dit(path, random_dit(TransformerConfig(), device, torch.bfloat16))
    emit(what="session_models", written=True, gb={"diffusion_model_gguf": round(path.stat().st_size / 1e9, 2)},
         seconds=round(time.perf_counter() - started, 1))  # fmt: skip


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def model_files(args) -> dict[str, str]:
    """The loader's file names (and the LoRA's, and with --control the branch's), with the files made if they are not
    there yet."""
    models = Path(args.models_dir)
    if args.tiny:
        from qwen21_nodes.qwen21_core.tiny import make_tiny

        started = time.perf_counter()
        paths = make_tiny(models)
        emit(what="session_models", written=True, tiny=True, seconds=round(time.perf_counter() - started, 1))
        dit = "gguf" if args.dit == "q4_k_m" else "transformer"  # tiny: make_tiny's GGUF (Q8_0 blocks)
        return {role: paths[name].name for role, name in
                (("diffusion_model", dit), ("text_encoder", "text_encoder"), ("vae", "vae"),
                 ("lora", "lora"), ("control", "control"))}  # fmt: skip
    full_size_files(models, args.device, args.comfyui_dir)
    files = {role: Path(name).name for role, name in FULL_SIZE_FILES.items()}
    if args.dit == "q4_k_m":
        if not (models / GGUF_DIT_FILE).is_file():  # a child process, as for the other files
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--write-gguf", "--models-dir",
                            str(models), "--device", args.device], check=True)  # fmt: skip
        files["diffusion_model"] = Path(GGUF_DIT_FILE).name
    if args.control:
        if not (models / CONTROL_FILE).is_file():  # a child process, as for the other files
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--write-control", "--models-dir",
                            str(models), "--device", args.device], check=True)  # fmt: skip
        files["control"] = Path(CONTROL_FILE).name
    return files


def full_size_files(models: Path, device: str, comfyui_dir: str) -> dict[str, Path]:
    """FULL_SIZE_FILES in `models` (role -> path), written first unless its written.json says they are there, with
    ComfyUI's Qwen tokenizer (from `comfyui_dir`) beside the text encoder. bench_loader_node.py reads them too."""
    marker = models / "written.json"
    if marker.is_file() and json.loads(marker.read_text()) == FULL_SIZE_FILES:
        sizes = {role: round((models / name).stat().st_size / 1e9, 2) for role, name in FULL_SIZE_FILES.items()}
        emit(what="session_models", written=False, gb=sizes, seconds=0)
    else:
        # a child process: the writer's GPU memory and CUDA context are gone before ComfyUI (or a load) starts
        command = [sys.executable, str(Path(__file__).resolve()), "--write-models", "--models-dir", str(models),
                   "--device", device, "--comfyui-dir", comfyui_dir]  # fmt: skip
        subprocess.run(command, check=True)
    return {role: models / name for role, name in FULL_SIZE_FILES.items()}


# ---- the server ----------------------------------------------------------------------------------------------


# Put beside the pack for a capped session: the hard cap, set once ComfyUI's own start-up (its allocator choice)
# is done, and the peak allocation since the last ask as a route.
CAP_NODE = """import os
import torch
from aiohttp import web
from server import PromptServer

NODE_CLASS_MAPPINGS = {}
_cap = float(os.environ.get("QWEN21_BENCH_HARD_CAP_GIB") or 0)
if _cap and torch.cuda.is_available():
    _total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, _cap * 2**30 / _total), 0)


@PromptServer.instance.routes.get("/qwen21_bench/peak")
async def _peak(request):
    peak = torch.cuda.max_memory_allocated(0) if torch.cuda.is_available() else 0
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(0)
    return web.json_response({"peak_bytes": peak, "cap_gib": _cap or None})
"""


class ComfyUI:
    """A ComfyUI server of our own (private base directory, the pack linked into custom_nodes, the models folder
    through extra_model_paths.yaml, the example images in input/), and one websocket client of it. `hard_cap_gib`:
    the server process may allocate no more on the GPU (CAP_NODE)."""

    def __init__(self, comfyui_dir: Path, python: str, models: Path, flags: list[str], log_path: Path,
                 pack: Path = REPO, hard_cap_gib: float | None = None):  # fmt: skip
        import websocket
        from qwen21_nodes.runner.cli import EXAMPLE_INPUTS

        self.base = Path(tempfile.mkdtemp(prefix="qwen21_comfyui_session_"))
        for folder in ("custom_nodes", "input", "output", "temp", "user"):
            (self.base / folder).mkdir()
        (self.base / "custom_nodes" / PACK_FOLDER).symlink_to(pack, target_is_directory=True)
        (self.base / "custom_nodes" / "qwen21_bench_cap.py").write_text(CAP_NODE)
        for image in EXAMPLE_INPUTS.glob("*.png"):  # the edits' reference images
            shutil.copyfile(image, self.base / "input" / image.name)
        kinds = "".join(
            f"    {kind}: {kind}\n" for kind in ("diffusion_models", "text_encoders", "vae", "loras", "model_patches")
        )
        (self.base / "extra_model_paths.yaml").write_text(f"qwen21_session:\n    base_path: {models}\n{kinds}")
        port = _free_port()
        command = [python, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--base-directory", str(self.base),
                   "--extra-model-paths-config", str(self.base / "extra_model_paths.yaml"),
                   "--database-url", "sqlite:///:memory:", *flags]  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "QWEN21_BENCH_HARD_CAP_GIB": "" if hard_cap_gib is None else str(hard_cap_gib)}  # fmt: skip
        with open(log_path, "w") as log_file:
            self.process = subprocess.Popen(command, cwd=comfyui_dir, stdout=log_file, stderr=subprocess.STDOUT,
                                            env=env)  # fmt: skip
        deadline = time.monotonic() + 300
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                self.stats = self.get("/system_stats")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("ComfyUI did not answer in 300 s:\n" + self.log()[-4000:]) from None
                time.sleep(0.5)
        self.client_id = f"qwen21-session-{port}"
        self.socket = websocket.create_connection(f"ws://127.0.0.1:{port}/ws?clientId={self.client_id}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as reply:
            return json.loads(reply.read())

    def queue(self, prompt: dict) -> tuple[int, dict]:
        body = json.dumps({"prompt": prompt, "client_id": self.client_id}).encode()
        request = urllib.request.Request(self.url + "/prompt", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    def messages(self, prompt_id: str, timeout: float):
        """(arrival time, type, data) of this prompt's JSON messages until it ends (binary previews skipped)."""
        self.socket.settimeout(timeout)
        while True:
            frame = self.socket.recv()
            now = time.perf_counter()
            if not isinstance(frame, str):
                continue
            message = json.loads(frame)
            data = message.get("data") or {}
            if data.get("prompt_id") != prompt_id:
                continue
            yield now, message["type"], data
            if message["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                return

    def close(self) -> None:
        try:
            self.socket.close()
        finally:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
            shutil.rmtree(self.base, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---- the session ---------------------------------------------------------------------------------------------


def with_files(prompt: dict, files: dict[str, str], dit: str = PRECISION) -> dict:
    """bench_session's prompt with the loader pointed at our files, in the session's precision (a GGUF DiT: auto,
    which keeps its blocks as they are stored)."""
    for node in prompt.values():
        if node["class_type"] == "Qwen21ModelLoader":
            node["inputs"].update(diffusion_model=files["diffusion_model"], text_encoder=files["text_encoder"],
                                  vae=files["vae"], weight_dtype=PRECISION if dit == PRECISION else "auto")  # fmt: skip
    return prompt


def with_control(prompt: dict, control_name: str) -> dict:
    """A text-to-image prompt with Fun-Control before its sampler (either sampler; after as_ksampler for KSampler):
    the branch loaded at fp8, the example's edge image, strength 1 over the whole schedule. Edits stay plain."""
    by_type = {node["class_type"]: node_id for node_id, node in prompt.items()}
    loader = by_type["Qwen21ModelLoader"]
    if any(node["class_type"] == "LoadImage" for node in prompt.values()):
        return prompt
    sampler = prompt[by_type.get("KSampler") or by_type["Qwen21Sampler"]]
    apply = "Qwen21ApplyControlModel" if sampler["class_type"] == "KSampler" else "Qwen21ApplyControl"
    prompt["control_image"] = {"class_type": "LoadImage", "inputs": {"image": CONTROL_IMAGE}}
    prompt["control_loader"] = {"class_type": "Qwen21ControlLoader", "inputs": {
        "model": [loader, 0], "control_name": control_name, "weight_dtype": PRECISION}}  # fmt: skip
    prompt["control_apply"] = {"class_type": apply, "inputs": {
        "model": sampler["inputs"]["model"], "control": ["control_loader", 0], "strength": 1.0, "start_percent": 0.0,
        "end_percent": 1.0, "control_image": ["control_image", 0]}}  # fmt: skip
    sampler["inputs"]["model"] = ["control_apply", 0]
    return prompt


def with_guidance(prompt: dict, cfg: float, negative: str) -> dict:
    """The prompt with guidance `cfg` (above 1 with the negative prompt `negative`)."""
    for node in prompt.values():
        if node["class_type"] == "Qwen21Sampler":
            node["inputs"]["true_cfg_scale"] = cfg
        if node["class_type"] == "Qwen21Encode" and cfg != 1:
            node["inputs"]["negative_prompt"] = negative
    return prompt


# Our sampling wrapper's line after a run through the MODEL (nodes/comfy/sampling.py)
MODEL_RUN_LINE = re.compile(r"qwen21: (\d+) model calls, (\d+) prefix computations, (\d+) replayed steps, prefix "
                            r"cache (\S+), decode graphs (.*?), peak ([\d.]+) GiB(?:, control (.*))?")  # fmt: skip


def as_ksampler(prompt: dict) -> dict:
    """bench_session's prompt (Qwen21 Sampler, Qwen21 VAE Decode, Qwen21 Load LoRA) as a user of ComfyUI's types
    builds it: KSampler (euler, simple, cfg 1) on the loader's MODEL with Qwen21 Encode's positive, negative and
    latent, VAE Decode with the loader's VAE, LoraLoaderModelOnly for a LoRA. The same seed, steps and size."""
    by_type = {node["class_type"]: node_id for node_id, node in prompt.items()}
    loader, encode = by_type["Qwen21ModelLoader"], by_type["Qwen21Encode"]
    model = [loader, 1]
    if "Qwen21LoraLoader" in by_type:
        lora = prompt[by_type["Qwen21LoraLoader"]]
        prompt[by_type["Qwen21LoraLoader"]] = {
            "class_type": "LoraLoaderModelOnly",
            "inputs": {
                "model": model,
                "lora_name": lora["inputs"]["lora_name"],
                "strength_model": lora["inputs"]["strength"],
            },
        }
        model = [by_type["Qwen21LoraLoader"], 0]
    encoder = prompt[encode]["inputs"]
    encoder["model"] = [loader, 0]
    sampler_id = by_type["Qwen21Sampler"]
    ours = prompt[sampler_id]["inputs"]
    prompt[sampler_id] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": ours["seed"], "steps": ours["steps"], "cfg": ours["true_cfg_scale"],
        "sampler_name": "euler", "scheduler": "simple", "positive": [encode, 3], "negative": [encode, 4],
        "latent_image": [encode, 5], "denoise": 1.0}}  # fmt: skip
    if ours["width"] and ours["height"]:  # a size of its own: an empty latent of that size, as a user makes one
        prompt["empty_latent"] = {"class_type": "Qwen21EmptyLatent", "inputs": {
            "width": ours["width"], "height": ours["height"], "batch_size": ours.get("batch_size", 1)}}  # fmt: skip
        prompt[sampler_id]["inputs"]["latent_image"] = ["empty_latent", 0]
    decode_id = by_type["Qwen21VAEDecode"]
    prompt[decode_id] = {"class_type": "VAEDecode", "inputs": {"samples": [sampler_id, 0], "vae": [loader, 2]}}
    return prompt


def run_prompt(server: ComfyUI, prompt: dict, row: dict, timeout: float) -> None:
    """Queue one prompt and wait for its end; fills `row` with its times, cache hits, stats and memory."""
    log_start = len(server.log())
    started = time.perf_counter()
    status, reply = server.queue(prompt)
    if status != 200:
        row["error"] = f"rejected ({status}): {json.dumps(reply)[:400]}"
        return
    starts, outputs, cached, end = [], {}, [], None
    for now, kind, data in server.messages(reply["prompt_id"], timeout):
        if kind == "execution_cached":
            cached = data.get("nodes") or []
        elif kind == "executing" and data.get("node") is not None:
            starts.append((data["node"], now))
        elif kind == "executed":
            outputs[data["node"]] = data.get("output") or {}
        elif kind == "execution_error":
            error = f"{data.get('exception_type')}: {data.get('exception_message')}"
            row["error"] = f"{data.get('node_type')}: {error}"[:400]
        elif kind == "execution_interrupted":
            row["error"] = f"interrupted in {data.get('node_type')}"
        end = now
    row["total_s"] = round(end - started, 3)
    # a node's time: from its `executing` message to the next node's (the last one's: to the end)
    for (node, at), (_next, until) in zip(starts, starts[1:] + [(None, end)], strict=True):
        name = NODE_PHASES.get(prompt[node]["class_type"], "other_s")
        row[name] = round(row.get(name, 0) + until - at, 3)
    row["cached"] = sorted(prompt[node]["class_type"] for node in cached)
    for node, output in outputs.items():
        if prompt[node]["class_type"] == "Qwen21Sampler" and output.get("qwen21_stats"):
            stats = output["qwen21_stats"][0]
            row["sample_inner_s"] = stats.get("seconds")
            row["plan"] = stats.get("plan")
            row["decode_graph"] = stats.get("decode_graph")
            row["prefill_graph"] = stats.get("prefill_graph")
            row["control_status"] = stats.get("control", "off")
            if stats.get("peak_vram_mib"):
                row["sample_peak_gib"] = round(stats["peak_vram_mib"] / 1024, 2)
    for found in MODEL_RUN_LINE.finditer(server.log()[log_start:]):  # a KSampler run on our MODEL
        calls, prefills, replayed, cache, graphs, peak, control = found.groups()
        row.update(model_calls=int(calls), prefix_computations=int(prefills), replayed_steps=int(replayed),
                   prefix_cache=cache, decode_graph=graphs.strip(), sample_peak_gib=float(peak),
                   control_status=control or "off")  # fmt: skip
    device = server.get("/system_stats")["devices"][0]
    if device.get("type") == "cuda":
        row["peak_allocated_gib"] = round(server.get("/qwen21_bench/peak")["peak_bytes"] / GIB, 2)
        row["allocated_after_gib"] = round((device["torch_vram_total"] - device["torch_vram_free"]) / GIB, 2)
        row["reserved_after_gib"] = round(device["torch_vram_total"] / GIB, 2)
    row["memory_log"] = [line.strip()[:200] for line in server.log()[log_start:].splitlines()
                         if MEMORY_LINE.search(line)][:12]  # fmt: skip


def run_session(args, files: dict[str, str], flags: list[str], cap: float | None) -> tuple[int, dict]:
    """One ComfyUI server (told a card of `cap` GiB, and held to it, where a cap is given), bench_session's prompts in
    order (through `args.sampler`) once per guidance scale of --cfgs; -> (failed prompts, {cfg: the summary})."""
    cache_dir = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    found = "warm" if cache_dir.is_dir() and any(cache_dir.iterdir()) else "empty"
    if cap is not None and args.device == "cuda":
        total_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        flags = [*flags, "--reserve-vram", f"{max(0.0, total_gib - cap):.3f}"]
    kind = dict(precision=PRECISION, dit=args.dit, cap_gib=cap, kernel_cache=found, via="comfyui", comfyui_flags=flags,
                sampler=args.sampler, control=args.control)  # fmt: skip
    log_dir = Path(args.log_dir or tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    pack = Path(args.pack_dir).resolve() if args.pack_dir else REPO
    name = (
        f"comfyui_session_server_{args.sampler}{'' if args.dit == PRECISION else '_' + args.dit}_"
        f"{'none' if cap is None else cap}"
        f"{'_control' * args.control}.txt"
    )
    server = ComfyUI(Path(args.comfyui_dir), args.comfyui_python, Path(args.models_dir), flags, log_dir / name, pack,
                     hard_cap_gib=cap)  # fmt: skip
    try:
        system = server.stats.get("system", {})
        if not args.save_node:  # the pack's own saver where the pack has it (an older release's has not)
            args.save_node = "Qwen21SaveImage" if server.get("/object_info/Qwen21SaveImage") else "SaveImage"
        emit(what="session_setup", **kind, start_s=round(time.perf_counter() - started, 1), steps=args.steps,
             comfyui_version=system.get("comfyui_version"), pytorch=system.get("pytorch_version"),
             device=server.stats["devices"][0].get("name"), log=str(server.log_path), files=files,
             pack=str(pack), save_node=args.save_node)  # fmt: skip
        specs = plan(args.tail)[: args.limit or None]
        failed, summaries, offset, lost = 0, {}, 0, None
        for cfg in args.cfgs:
            rows, seen = [], set()
            for index, spec in enumerate(specs):
                number = offset + index  # every prompt's text new, also across guidance scales
                text_index = number if spec["changed"] else number - 1  # the rerun: the previous prompt's text
                prompt = with_files(session_prompt(spec, number, args, files["lora"], text_index), files, args.dit)
                prompt = with_guidance(prompt, cfg, args.negative)
                if args.sampler == "ksampler":
                    prompt = as_ksampler(prompt)
                if args.control:
                    prompt = with_control(prompt, files["control"])
                shape = spec["label"] + (":lora" if spec["lora"] is not None else "")
                row = dict(what="session_prompt", **kind, cfg=cfg, i=number, label=shape,
                           first_of_shape=shape not in seen, changed_prompt=spec["changed"],
                           lora_strength=spec["lora"])  # fmt: skip
                seen.add(shape)
                try:
                    run_prompt(server, prompt, row, args.prompt_timeout)
                except Exception as error:  # noqa: BLE001 - the client lost the server (a timeout, an exit)
                    lost = row["error"] = f"client: {type(error).__name__}: {str(error)[:300]}"
                    row["server_returncode"] = server.process.poll()
                emit(**row)
                rows.append(row)
                if lost:
                    break
            offset += len(specs)
            summaries[cfg] = summary(rows, {**kind, "cfg": cfg}, rows[0].get("loader_s") if rows else None, None)
            peaks = [row["peak_allocated_gib"] for row in rows if "peak_allocated_gib" in row]
            summaries[cfg]["peak_allocated_max_gib"] = max(peaks) if peaks else None
            emit(**summaries[cfg])
            failed += sum("error" in row for row in rows)
            if lost:
                break
        return failed, summaries
    finally:
        server.close()


def comfyui_flags(args) -> list[str]:
    """The server's flags that change what is measured: --cpu on the CPU, COMFYUI_EXTRA_ARGS (as the server tests
    take it) and --extra-args."""
    flags = ["--cpu"] if args.device == "cpu" else []
    flags += shlex.split(os.environ.get("COMFYUI_EXTRA_ARGS", ""))
    return flags + [flag for value in args.extra_args for flag in shlex.split(value)]


def _default_python(comfyui_dir: str) -> str:
    for venv in ("venv", ".venv"):
        candidate = Path(comfyui_dir) / venv / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    return sys.executable


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--tail", type=int, default=20, help="the mixed tail's length (bench_session's plan)")
    parser.add_argument("--models-dir", default="", help="model files; full size: written once, reused if present")
    parser.add_argument("--limit", type=int, default=0, help="only the plan's first N prompts (0: all)")
    parser.add_argument("--pack-dir", default="", help="the pack ComfyUI loads (default: this tree)")
    parser.add_argument("--save-node", default="", choices=["", *SAVE_NODES],
                        help="the node that saves each image (default: the pack's Qwen21SaveImage where it has one, "
                        "else ComfyUI's SaveImage)")  # fmt: skip
    parser.add_argument("--extra-args", action="append", default=[],
                        help="ComfyUI flags, e.g. --extra-args=--disable-cuda-malloc (repeatable)")  # fmt: skip
    parser.add_argument("--comfyui-dir", default=os.environ.get("COMFYUI_DIR", ""))
    parser.add_argument("--comfyui-python", default=os.environ.get("COMFYUI_PYTHON", ""))
    parser.add_argument("--prompt-timeout", type=float, default=600, help="seconds one prompt may take")
    parser.add_argument("--log-dir", default="")
    parser.add_argument("--samplers", default="qwen21",
                        help="comma-separated, one server session each, in order: qwen21 (Qwen21 Sampler and our "
                        "nodes) and/or ksampler (KSampler, VAE Decode, LoraLoaderModelOnly on the loader's MODEL "
                        "and VAE); with both, a ksampler_vs_qwen21 line compares their steady images")  # fmt: skip
    parser.add_argument("--caps", default="none",
                        help="comma-separated card sizes in GiB, one server each (none: the whole card), e.g. "
                        "none,24,16,12")  # fmt: skip
    parser.add_argument("--cfgs", default="1", help="comma-separated guidance scales, each a pass over the prompts")
    parser.add_argument("--negative", default="blurry, low quality, distorted", help="the negative prompt at cfg > 1")
    parser.add_argument(
        "--control", action="store_true", help="Fun-Control on every text-to-image prompt (see the module docstring)"
    )
    parser.add_argument("--dit", default="fp8", help="comma-separated DiT files, each a pass over --caps and "
                        "--samplers: fp8 (Comfy-Org's fp8_scaled layout) and/or q4_k_m (a GGUF in ComfyUI-GGUF's "
                        "layout, loaded with weight_dtype auto)")  # fmt: skip
    parser.add_argument("--write-models", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write-gguf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write-control", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tiny:
        args.steps = min(args.steps, 2)
        args.tail = min(args.tail, 2)
    if args.write_control:
        write_control(Path(args.models_dir or FULL_SIZE_DIR) / CONTROL_FILE, torch.device(args.device))
        return 0
    if args.write_gguf:
        write_full_size_gguf(Path(args.models_dir or FULL_SIZE_DIR) / GGUF_DIT_FILE, torch.device(args.device))
        return 0
    if args.write_models:  # only ComfyUI's Qwen tokenizer is needed (copied beside the text encoder)
        from qwen21_nodes.qwen21_core.checkpoints.loading import COMFYUI_TOKENIZER_DIR

        if not (Path(args.comfyui_dir) / COMFYUI_TOKENIZER_DIR).is_dir():
            parser.error(f"writing the files needs ComfyUI's {COMFYUI_TOKENIZER_DIR} under --comfyui-dir")
        write_full_size(Path(args.models_dir or FULL_SIZE_DIR), torch.device(args.device), Path(args.comfyui_dir))
        return 0
    if not args.comfyui_dir or not (Path(args.comfyui_dir) / "main.py").is_file():
        parser.error("give a ComfyUI checkout (with main.py) as COMFYUI_DIR or --comfyui-dir")
    if not args.tiny and args.device == "cpu":
        parser.error("the full-size session needs --device cuda (on a CPU: --tiny)")
    args.comfyui_python = args.comfyui_python or _default_python(args.comfyui_dir)
    # stopped at a time limit (SIGTERM): leave through the `finally` that stops the server
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    temporary = args.tiny and not args.models_dir  # tiny files made for this run only
    if temporary:
        args.models_dir = tempfile.mkdtemp(prefix="qwen21_session_tiny_")
    args.models_dir = args.models_dir or FULL_SIZE_DIR
    samplers = [name.strip() for name in args.samplers.split(",") if name.strip()]
    if not samplers or set(samplers) - {"qwen21", "ksampler"}:
        parser.error(f"--samplers takes qwen21 and/or ksampler, got {args.samplers!r}")
    caps = [None if cap.strip() in ("none", "") else float(cap) for cap in args.caps.split(",")]
    dits = [name.strip() for name in args.dit.split(",") if name.strip()]
    if not dits or set(dits) - set(DITS):
        parser.error(f"--dit takes {' and/or '.join(DITS)}, got {args.dit!r}")
    args.cfgs = [float(cfg) for cfg in args.cfgs.split(",")]
    try:
        failures = 0
        for dit in dits:
            args.dit = dit
            for cap in caps:
                summaries = {}
                for name in samplers:
                    args.sampler = name
                    failed, summaries[name] = run_session(args, model_files(args), comfyui_flags(args), cap)
                    failures += failed
                if {"qwen21", "ksampler"} <= summaries.keys():
                    for cfg in args.cfgs:
                        ours, theirs = summaries["qwen21"].get(cfg, {}), summaries["ksampler"].get(cfg, {})
                        ratio = (round(theirs["steady_image_s"] / ours["steady_image_s"], 3)
                                 if ours.get("steady_image_s") and theirs.get("steady_image_s") else None)  # fmt: skip
                        emit(what="ksampler_vs_qwen21", dit=dit, cap_gib=cap, cfg=cfg, control=args.control,
                             steady_ratio=ratio, qwen21_steady_s=ours.get("steady_image_s"),
                             ksampler_steady_s=theirs.get("steady_image_s"), qwen21_first_s=ours.get("first_image_s"),
                             ksampler_first_s=theirs.get("first_image_s"))  # fmt: skip
        return 1 if failures else 0
    finally:
        if temporary:
            shutil.rmtree(args.models_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
