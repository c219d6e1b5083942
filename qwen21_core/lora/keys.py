"""LoRA key formats -> the names of our transformer's layers.

A LoRA file names each adapted layer (its "stem") and the role of each tensor (a suffix). Formats seen in the wild
for diffusion transformers (facts from diffusers' lora_conversion_utils and ComfyUI's comfy/lora.py and
comfy/weight_adapter/lora.py):

- diffusers / PEFT: `transformer.<layer>.lora_A.weight` (down) and `.lora_B.weight` (up); the alpha sits in the
  safetensors metadata (`lora_adapter_metadata`, see reading.py) or in a `<layer>.alpha` tensor. Also without the
  `transformer.` prefix, behind `base_model.model.` (a PEFT model's own names), and with PEFT's adapter name
  (`.lora_A.default.weight`).
- kohya / sd-scripts: `lora_unet_<layer with dots as underscores>.lora_down.weight`, `.lora_up.weight`, `.alpha`;
  SimpleTuner's LyCORIS files use `lycoris_` and OneTrainer `lora_transformer_` in place of `lora_unet_`.
- ComfyUI-saved LoRAs (its LoRA extract node, trainers that target ComfyUI): `diffusion_model.<layer>.lora_down.weight`
  / `.lora_up.weight` / `.alpha`, and full weight differences as `<layer>.diff`. ComfyUI also accepts the older
  diffusers spellings `_lora.up.weight`, `.lora.up.weight`, `.lora_linear_layer.up.weight` and bare `.lora_B`.

Layer names are our checkpoint names (diffusers'), plus the fused layouts ComfyUI's and our modules use:
`attn.to_qkv` (rows q | k | v) and `img_mlp.gate_up` (rows gate | up).
"""

from __future__ import annotations

from collections.abc import Iterable

# suffix -> role; the longest matching suffix wins (".lora_B.default.weight" before ".lora_B").
ROLE_SUFFIXES = {
    ".lora_up.weight": "up",
    ".lora_down.weight": "down",
    ".lora_B.weight": "up",
    ".lora_A.weight": "down",
    ".lora_B.default.weight": "up",
    ".lora_A.default.weight": "down",
    ".lora.up.weight": "up",
    ".lora.down.weight": "down",
    "_lora.up.weight": "up",
    "_lora.down.weight": "down",
    ".lora_linear_layer.up.weight": "up",
    ".lora_linear_layer.down.weight": "down",
    ".lora_B": "up",
    ".lora_A": "down",
    ".alpha": "alpha",
    ".diff": "diff",
    ".w_norm": "diff",  # LyCORIS norm patches: a full difference, as ComfyUI applies them
}
_SUFFIXES_LONGEST_FIRST = sorted(ROLE_SUFFIXES, key=len, reverse=True)

# Key fragments of adapter kinds we cannot merge as W + B @ A, and what to call them.
UNSUPPORTED = (
    ("hada_w", "LoHa (LyCORIS Hadamard-product adapter)"),
    ("hada_t", "LoHa (LyCORIS Hadamard-product adapter)"),
    ("lokr_", "LoKr (LyCORIS Kronecker-product adapter)"),
    (".dora_scale", "DoRA (weight-decomposed LoRA)"),
    ("lora_magnitude_vector", "DoRA (weight-decomposed LoRA)"),
    (".oft_", "OFT/BOFT (orthogonal fine-tuning)"),
    (".lora_mid.weight", "LoCon/Tucker mid weights (convolution LoRA)"),
    (".a1.weight", "GLoRA"),
    (".b1.weight", "GLoRA"),
    (".diff_b", "bias differences (Qwen-Image-2.1 has no biases)"),
    (".lora_B.bias", "LoRA biases (Qwen-Image-2.1 has no biases)"),
    (".b_norm", "norm bias patches (Qwen-Image-2.1 has no biases)"),
    (".set_weight", "weight replacement patches (set_weight)"),
    (".reshape_weight", "reshaping patches (reshape_weight)"),
)

# Dotted prefixes stripped from a stem (repeatedly, in any order they appear).
DOTTED_PREFIXES = ("base_model.model.", "transformer.", "model.diffusion_model.", "diffusion_model.")
# Prefixes of flattened stems (dots replaced by underscores).
FLAT_PREFIXES = ("lora_unet_", "lycoris_", "lora_transformer_")
# Prefixes of text-encoder LoRA parts: Qwen-Image-2.1 LoRAs adapt the DiT only; we do not patch the text encoder.
TEXT_ENCODER_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "text_encoder.", "text_encoders.", "te.")


def split_key(key: str) -> tuple[str, str] | None:
    """A LoRA tensor key -> (stem, role) with role in up / down / alpha / diff; None if no known suffix."""
    for suffix in _SUFFIXES_LONGEST_FIRST:
        if key.endswith(suffix):
            return key[: -len(suffix)], ROLE_SUFFIXES[suffix]
    return None


def unsupported_kind(key: str) -> str | None:
    """The name of the adapter kind a key belongs to, if it is one we refuse (LoHa, LoKr, DoRA, ...)."""
    return next((what for fragment, what in UNSUPPORTED if fragment in key), None)


def is_text_encoder(stem: str) -> bool:
    return stem.startswith(TEXT_ENCODER_PREFIXES)


class LayerNames:
    """Resolves the stems of any format above to our layer names (the given `layers`)."""

    def __init__(self, layers: Iterable[str]):
        self.layers = set(layers)
        # flattened names are made from real names, so they map back unambiguously
        self.flat = {name.replace(".", "_"): name for name in self.layers}

    def resolve(self, stem: str) -> str | None:
        for prefix in FLAT_PREFIXES:
            if stem.startswith(prefix):
                return self.flat.get(stem[len(prefix) :])
        name = stem
        stripped = True
        while stripped:
            stripped = False
            for prefix in DOTTED_PREFIXES:
                if name.startswith(prefix):
                    name, stripped = name[len(prefix) :], True
        return name if name in self.layers else None


def foreign_model_hint(stems: Iterable[str]) -> str:
    """A few words on which model a LoRA's unmatched layer names point to ('' if they say nothing)."""
    text = " ".join(stems)
    hints = (
        (("add_q_proj", "add_k_proj", "txt_mlp", "img_mod", "txt_mod", "to_add_out", "img_mlp.net", "img_mlp_net"),
         "Qwen-Image 1.x / Qwen-Image-Edit (double-stream blocks)"),
        (("double_blocks", "single_blocks", "single_transformer_blocks"), "Flux"),
        (("self_attn", "cross_attn", "ffn"), "Wan"),
        (("input_blocks", "output_blocks", "down_blocks", "up_blocks", "mid_block"), "a Stable Diffusion UNet"),
        (("joint_blocks",), "Stable Diffusion 3"),
    )  # fmt: skip
    for fragments, model in hints:
        if any(fragment in text for fragment in fragments):
            return f" Its layer names look like a LoRA for {model}, not Qwen-Image-2.1."
    return ""
