"""LoRA node: QWEN21_MODEL + a LoRA file + strength -> a QWEN21_MODEL whose DiT runs with that LoRA."""

from __future__ import annotations

import logging

from . import host
from .model import MODEL_TYPE

log = logging.getLogger(__name__)


class Qwen21LoraLoader:
    """Apply a LoRA to the Qwen-Image-2.1 diffusion model. Chain several for several LoRAs. The LoRA is merged into
    the weights right before sampling, so the prefix cache and CUDA-graph decode stay on and each step costs what it
    costs without a LoRA; other branches of the graph keep their own LoRAs."""

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
            }
        }

    def load(self, model, lora_name, strength):
        lora = model.pipe.load_lora(host.weight_file_path("loras", lora_name))
        log.info("LoRA %s at strength %s: %d layers (%s)", lora_name, strength, len(lora.layers), lora.format)
        return (model.with_lora(lora, strength),)
