"""`make_tiny(dir)`: a random-weight Qwen-Image-2.1 checkpoint of a few MB, in every layout we load.

`dir` becomes a ComfyUI models folder:

    dir/diffusion_models/qwen_image_2.1_tiny.safetensors   transformer, ComfyUI layout (prefix, fused gate_up)
    dir/diffusion_models/qwen_image_2.1_tiny_Q8_0.gguf     the same transformer as a GGUF (block Linears in Q8_0)
    dir/vae/qwen_image_2.1_vae_tiny.safetensors            VAE, ComfyUI (Wan 2.2) layout, 5-D conv weights
    dir/text_encoders/qwen3vl_tiny.safetensors             Qwen3-VL, the transformers names Comfy-Org ships
    dir/text_encoders/qwen3vl_tiny.json                    its config (not the 8B, so it must be given)
    dir/text_encoders/qwen3vl_tiny/                        its tokenizer/processor (found next to the file)
    dir/diffusers/qwen_image_2.1_tiny/                     the same weights as a diffusers pipeline folder,
    dir/diffusers/qwen_image_2.1_tiny_turbo/               and as a turbo one (model_index sample_sigmas)
    dir/loras/tiny_turbo_lora.safetensors                  a random LoRA on every block linear, ComfyUI key names
    dir/model_patches/qwen_image_2.1_tiny_fun_control.safetensors
                                                           a Fun-Controlnet-Union branch for it (one control block),
                                                           named and tagged as ComfyUI's repack of the released one

The diffusers folders are laid out like the released repository (model_index.json with the same classes,
a sharded transformer, scheduler_config.json with the released values), so diffusers' own
`QwenImage21Pipeline.from_pretrained` loads them. Weights come from our modules' default initialisation
under a seed, with the norm weights perturbed so that they are not all ones; a 64x64 image takes well
under a second on a CPU and is neither blank nor NaN.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoints import key_maps
from .config import QWEN21_SCHEDULER, TransformerConfig, VAEConfig
from .dit.control import FunControlNet
from .dit.transformer import QwenImage21Transformer
from .text.tiny import TINY_HIDDEN_SIZE, save_tiny_text_encoder
from .vae.model import QwenImage21VAE

DIFFUSERS_VERSION = "0.42.1"
TINY_TRANSFORMER = TransformerConfig(
    in_channels=64,
    out_channels=64,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=2,
    context_in_dim=TINY_HIDDEN_SIZE,
    axes_dims_rope=(4, 14, 14),  # the split loading.py derives for 32-wide heads
)
TINY_VAE = VAEConfig(base_dim=8, decoder_base_dim=12, dim_mult=(1, 2, 2, 2, 2))  # 16x, 64 latent channels, RGBA
TURBO_SIGMAS = (1.0, 0.8, 0.55, 0.3)
MODEL_INDEX = {
    "_class_name": "QwenImage21Pipeline",
    "_diffusers_version": DIFFUSERS_VERSION,
    "processor": ["transformers", "Qwen3VLProcessor"],
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage21"],
}
NAMES = {
    "transformer": "diffusion_models/qwen_image_2.1_tiny.safetensors",
    "vae": "vae/qwen_image_2.1_vae_tiny.safetensors",
    "text_encoder": "text_encoders/qwen3vl_tiny.safetensors",
    "diffusers": "diffusers/qwen_image_2.1_tiny",
    "diffusers_turbo": "diffusers/qwen_image_2.1_tiny_turbo",
    "lora": "loras/tiny_turbo_lora.safetensors",
    "gguf": "diffusion_models/qwen_image_2.1_tiny_Q8_0.gguf",
    "control": "model_patches/qwen_image_2.1_tiny_fun_control.safetensors",
}
TINY_CONTROL_BLOCKS = 1
# the header metadata of ComfyUI's repack of the released Fun-Controlnet-Union file (its tensors are the original's)
CONTROL_METADATA = {"comfyui.model_type": "MODEL_PATCH", "comfyui.base_model": "Qwen-Image-2.1",
                    "comfyui.control_modes": "Canny,Depth,Grayscale,HED,Lineart,MLSD,Pose,Scribble,Inpaint"}
TINY_LORA_RANK = 4


def make_tiny(dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write the tiny checkpoint set into `dir` (see the module docstring); returns the paths by role:
    models, transformer, vae, text_encoder, tokenizer, diffusers, diffusers_turbo, lora, gguf, control."""
    root = Path(dir)
    paths = {"models": root, **{role: root / name for role, name in NAMES.items()}}
    paths["tokenizer"] = paths["text_encoder"].with_suffix("")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = tiny_transformer_state_dict()
        vae = tiny_vae_state_dict()
        lora = tiny_lora_state_dict()
        control = tiny_control_state_dict()

    folder = paths["diffusers"]
    _write_diffusers_folder(folder, transformer, vae, seed)
    turbo = paths["diffusers_turbo"]
    if turbo.exists():
        shutil.rmtree(turbo)
    shutil.copytree(folder, turbo)
    _write_json(turbo / "model_index.json", {**MODEL_INDEX, "sample_sigmas": list(TURBO_SIGMAS)})

    _save(key_maps.dit_to_comfyui(transformer), paths["transformer"])
    _write_gguf_transformer(key_maps.dit_to_comfyui(transformer, prefix=""), paths["gguf"])
    _save(key_maps.vae_to_comfyui(vae, TINY_VAE.num_res_blocks), paths["vae"])
    _write_comfy_text_encoder(folder, paths["text_encoder"], paths["tokenizer"])
    _save(lora, paths["lora"])
    _save(control, paths["control"], CONTROL_METADATA)
    return paths


def tiny_transformer_state_dict() -> dict[str, torch.Tensor]:
    """Diffusers-named weights of our transformer with TINY_TRANSFORMER (draws from the global RNG)."""
    model = QwenImage21Transformer(TINY_TRANSFORMER)
    weights = {name: tensor.detach().clone() for name, tensor in model.checkpoint_slots().items()}
    for name, tensor in weights.items():
        if name.endswith(("norm_q.weight", "norm_k.weight")):
            tensor.add_(0.1 * torch.randn_like(tensor))  # standard RMSNorm: scale around 1
        elif name == "txt_in.text_norm.weight":
            tensor.copy_(0.1 * torch.randn_like(tensor))  # zero-centred RMSNorm: effective scale w + 1
    return weights


def tiny_control_state_dict() -> dict[str, torch.Tensor]:
    """The released file's names for a Fun-Control branch of TINY_TRANSFORMER (draws from the global RNG)."""
    model = FunControlNet(TINY_TRANSFORMER, TINY_CONTROL_BLOCKS)
    weights = {name: tensor.detach().clone() for name, tensor in model.checkpoint_slots().items()}
    for name, tensor in weights.items():
        if name.endswith(("norm_q.weight", "norm_k.weight")):
            tensor.add_(0.1 * torch.randn_like(tensor))
    return weights


def tiny_lora_state_dict(rank: int = TINY_LORA_RANK) -> dict[str, torch.Tensor]:
    """A LoRA on every block linear of TINY_TRANSFORMER (fused gate_up, as ComfyUI names it), in the key format
    ComfyUI saves (`diffusion_model.<layer>.lora_down/lora_up.weight`, `.alpha`); its deltas are about as large
    as the weights, so it visibly changes an image (draws from the global RNG)."""
    config = TINY_TRANSFORMER
    dim, hidden = config.inner_dim, config.mlp_dim
    shapes = {"attn.to_q": (dim, dim), "attn.to_k": (dim, dim), "attn.to_v": (dim, dim), "attn.to_out.0": (dim, dim),
              "img_mlp.gate_up": (2 * hidden, dim), "img_mlp.out": (dim, hidden)}  # fmt: skip
    weights = {}
    for i in range(config.num_layers):
        for layer, (rows, cols) in shapes.items():
            stem = f"diffusion_model.transformer_blocks.{i}.{layer}"
            weights[f"{stem}.lora_down.weight"] = torch.randn(rank, cols) / cols**0.5
            weights[f"{stem}.lora_up.weight"] = torch.randn(rows, rank) / cols**0.5
            weights[f"{stem}.alpha"] = torch.tensor(float(rank))
    return weights


def tiny_vae_state_dict() -> dict[str, torch.Tensor]:
    """Diffusers-named weights of our VAE with TINY_VAE, including the unused time_conv tensors."""
    model = QwenImage21VAE(TINY_VAE)
    weights = {}
    for name, tensor in model.checkpoint_slots().items():
        if tensor is None:  # read and dropped by us, but part of the diffusers layout
            tensor = 0.02 * torch.randn(model.dropped_checkpoint_keys()[name])
        weights[name] = tensor.detach().clone()
        if name.endswith(".gamma"):
            weights[name].add_(0.1 * torch.randn_like(tensor))
    return weights


def _write_diffusers_folder(folder: Path, transformer, vae, seed: int) -> None:
    _write_json(folder / "model_index.json", MODEL_INDEX)
    _write_json(
        folder / "transformer" / "config.json", _diffusers_config("QwenImage21Transformer2DModel", TINY_TRANSFORMER)
    )
    _save_sharded(transformer, folder / "transformer", "diffusion_pytorch_model", shards=2)
    _write_json(folder / "vae" / "config.json", _diffusers_config("AutoencoderKLQwenImage21", TINY_VAE))
    _save(vae, folder / "vae" / "diffusion_pytorch_model.safetensors")
    scheduler = {"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": DIFFUSERS_VERSION}
    _write_json(folder / "scheduler" / "scheduler_config.json", {**scheduler, **QWEN21_SCHEDULER.to_dict()})
    save_tiny_text_encoder(folder, seed=seed)  # text_encoder/ and processor/


def _write_comfy_text_encoder(folder: Path, file: Path, tokenizer_dir: Path) -> None:
    """The diffusers text encoder as one file with the names Comfy-Org's Qwen3-VL files use (the transformers
    ones), its config beside it, and its processor in a folder named after it."""
    from safetensors import safe_open

    with safe_open(folder / "text_encoder" / "model.safetensors", framework="pt") as f:
        weights = {key: f.get_tensor(key) for key in f.keys()}  # tiny: a few hundred kB
    _save(weights, file)
    shutil.copyfile(folder / "text_encoder" / "config.json", file.with_suffix(".json"))
    if tokenizer_dir.exists():
        shutil.rmtree(tokenizer_dir)
    shutil.copytree(folder / "processor", tokenizer_dir)


def _write_gguf_transformer(weights: dict[str, torch.Tensor], path: Path) -> None:
    """The tiny DiT as a GGUF file the way ComfyUI-GGUF's converter writes one from ComfyUI's file: bare module names
    (fused gate_up), the block Linears in Q8_0, the other tensors in F32."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "qwen_image21")
    for name, tensor in weights.items():
        values = tensor.float().numpy()
        if "transformer_blocks." in name and values.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _diffusers_config(class_name: str, config) -> dict:
    return {"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION, **config.to_dict()}


def _save(weights: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, path, metadata=metadata)


def _save_sharded(weights: dict[str, torch.Tensor], folder: Path, stem: str, shards: int) -> None:
    """`stem`-00001-of-0000N.safetensors ... plus `stem`.safetensors.index.json, as diffusers writes them."""
    keys = list(weights)
    per_shard = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i * per_shard : (i + 1) * per_shard]
        _save({k: weights[k] for k in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    _write_json(
        folder / f"{stem}.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map}
    )


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
