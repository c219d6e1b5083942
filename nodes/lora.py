"""LoRA node: QWEN21_MODEL + a LoRA file + strength -> a QWEN21_MODEL whose DiT runs with that LoRA."""

from __future__ import annotations

import logging

from . import host
from .model import MODEL_TYPE

log = logging.getLogger(__name__)

MODES = ("merge", "side_path")
MODE_TOOLTIP = (
    "How the LoRA goes onto fp8 / int8 / int8_convrot weights. merge (default): added into them before sampling "
    "and requantised in their format, so a step costs what it costs without the LoRA. A bf16 file loaded as "
    "fp8/int8 is merged from the file's own weights and rounded once; a quantised file's values are rounded a "
    "second time, a little more error than the format has anyway (BENCHMARKS.md, LoRA). Removing or changing the "
    "LoRA restores the loaded weights bit for bit first. side_path: the quantised weights stay untouched and the "
    "LoRA runs beside them each step: exact, but adapted layers get extra GEMMs and lose their fused activation "
    "quantisation, so steps are slower. On bf16 / fp32 weights both merge (exact to one rounding)."
)


class Qwen21LoraLoader:
    """Apply a LoRA to the Qwen-Image-2.1 diffusion model. Chain several for several LoRAs. The LoRA is merged into
    the weights right before sampling (fp8 / int8 weights are requantised in their own format), so the prefix cache
    and CUDA-graph decode stay on and each step costs what it costs without a LoRA; other branches of the graph keep
    their own LoRAs. On quantised weights, mode side_path runs it beside them instead: exact, slower steps."""

    CATEGORY = "Qwen21/loaders"
    DESCRIPTION = __doc__
    RETURN_TYPES = (MODEL_TYPE,)
    RETURN_NAMES = ("model",)
    OUTPUT_TOOLTIPS = ("The same model with this LoRA added to the ones already on it; the input model is unchanged.",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "From a Qwen21 loader, or another Qwen21 Load LoRA to stack LoRAs."}),
                "lora_name": (
                    host.list_weight_files("loras"),
                    {
                        "tooltip": "A Qwen-Image-2.1 LoRA (.safetensors) from models/loras: diffusers/PEFT, kohya "
                        "or ComfyUI key names. LoRAs for other models, LoHa/LoKr and DoRA are refused with an error."
                    },
                ),
                "strength": (
                    "FLOAT",
                    {
                        "default": 1.0,
                        "min": -100.0,
                        "max": 100.0,
                        "step": 0.01,
                        "tooltip": "How much of the LoRA: 1.0 as trained, 0 off, negative subtracts it. Changing it "
                        "re-merges the weights once before the next sampling; steps cost the same at any value.",
                    },
                ),
            },
            # optional, so that workflows saved before it existed load unchanged (absent = merge)
            "optional": {
                "mode": (
                    list(MODES),
                    {"default": MODES[0], "tooltip": MODE_TOOLTIP},
                ),
            },
        }

    @classmethod
    def IS_CHANGED(cls, lora_name, **_inputs):
        return host.file_identity(host.weight_file_path("loras", lora_name))  # an edited file is read again

    def load(self, model, lora_name, strength, mode=MODES[0]):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
        lora = model.pipe.load_lora(host.weight_file_path("loras", lora_name), side_path=mode == "side_path")
        log.info("LoRA %s at strength %s (%s): %d layers (%s)", lora_name, strength, mode, len(lora.layers),
                 lora.format)  # fmt: skip
        return (model.with_lora(lora, strength),)
