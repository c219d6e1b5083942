"""Control and inpainting nodes (Qwen-Image-2.1 Fun-Controlnet-Union): load the branch, apply it to a QWEN21_MODEL (our
sampler) or to a MODEL (KSampler and ComfyUI's other samplers). The math is qwen21_core's (control.py, dit/control.py);
inside ComfyUI the branch's weights are registered with its memory manager beside the DiT's."""

from __future__ import annotations

import logging

from ..qwen21_core.control import STRENGTH_RANGE, Control
from . import host
from .memory_adapter import ManagedModules
from .model import MODEL_TYPE

log = logging.getLogger(__name__)

CONTROL_TYPE = "QWEN21_CONTROL"
CONTROL_FOLDERS = ("model_patches", "controlnet")  # native ComfyUI's ModelPatchLoader folder first
# weight_dtype choice -> the loader's weight format (quant/plan.py); "bf16": everything in the DiT's compute dtype
WEIGHT_CHOICES = {"auto": "auto", "bf16": "none", "fp8": "fp8", "int8": "int8", "int8_convrot": "int8_convrot"}


class ControlHandle:
    """What a QWEN21_CONTROL link carries: the loaded branch and its registration with the memory manager."""

    def __init__(self, net, name: str, device):
        self.net = net
        self.name = name
        self.weights = ManagedModules({"fun_control": net}, device, streamable=net)

    def __repr__(self) -> str:
        return f"ControlHandle({self.name}, {len(self.net.control_blocks)} blocks, {self.net.quantization})"


def list_control_files() -> list[str]:
    names = set()
    for kind in CONTROL_FOLDERS:
        names.update(host.list_weight_files(kind))
    return sorted(name for name in names if not name.endswith(".gguf"))


def control_file_path(name: str) -> str:
    missing = None
    for kind in CONTROL_FOLDERS:
        try:
            return host.weight_file_path(kind, name)
        except FileNotFoundError as error:
            missing = error
    raise FileNotFoundError(f"Fun-Control file {name!r} is in neither models/model_patches nor models/controlnet "
                            f"({missing})")  # fmt: skip


class Qwen21ControlLoader:
    """Load a Qwen-Image-2.1 Fun-Controlnet-Union file (control: canny, depth, pose, lineart, HED, MLSD, scribble,
    grayscale; and inpainting) for a Qwen21 model: alibaba-pai's original or ComfyUI's repack, from models/model_patches
    or models/controlnet. Its 16 blocks run beside the DiT's with the same prefix cache and CUDA graphs."""

    CATEGORY = "Qwen21/loaders"
    DESCRIPTION = __doc__
    RETURN_TYPES = (CONTROL_TYPE,)
    RETURN_NAMES = ("control",)
    OUTPUT_TOOLTIPS = ("The control branch, for Qwen21 Apply Fun Control (QWEN21_MODEL or MODEL).",)
    FUNCTION = "load"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "The Qwen21 model the branch runs beside (its size is checked)."}),
                "control_name": (
                    list_control_files(),
                    {"tooltip": "A Qwen-Image-2.1 Fun-Controlnet-Union .safetensors from models/model_patches or "
                                "models/controlnet. A ControlNet for another model is refused by name."},
                ),  # fmt: skip
                "weight_dtype": (
                    list(WEIGHT_CHOICES),
                    {
                        "default": "auto",
                        "tooltip": "auto: the file's own format (a bf16 file in the DiT's compute dtype). fp8 / int8 "
                        "/ int8_convrot: the control blocks' Linears and their skip projections quantised at load "
                        "(half the memory of bf16), as for the DiT. bf16: dequantise a quantised file.",
                    },
                ),
            }
        }

    @classmethod
    def IS_CHANGED(cls, control_name, **_inputs):
        return host.file_identity(control_file_path(control_name))

    def load(self, model, control_name, weight_dtype):
        if weight_dtype not in WEIGHT_CHOICES:
            raise ValueError(f"weight_dtype must be one of {list(WEIGHT_CHOICES)}, got {weight_dtype!r}")
        # read into RAM: the memory manager places it beside the DiT when a run needs it (a 12 GB card may not hold
        # both at load time)
        net = model.pipe.load_control(control_file_path(control_name), WEIGHT_CHOICES[weight_dtype],
                                      device=host.offload_device())  # fmt: skip
        return (ControlHandle(net, control_name, model.device),)


def _control_inputs(model_type: str, model_tooltip: str) -> dict:
    low, high = STRENGTH_RANGE
    return {
        "required": {
            "model": (model_type, {"tooltip": model_tooltip}),
            "control": (CONTROL_TYPE, {"tooltip": "From Qwen21 Load Fun Control."}),
            "strength": ("FLOAT", {"default": 1.0, "min": low, "max": high, "step": 0.01,
                                   "tooltip": "How much of the branch is added: 1.0 as trained, 0 off (the plain "
                                              "model, exactly)."}),  # fmt: skip
            "start_percent": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.001,
                                        "tooltip": "Where in the schedule control starts (0 = the first step)."}),
            "end_percent": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.001,
                                      "tooltip": "Where it stops (1 = the last step). Steps outside run the plain "
                                                 "model at the plain model's cost."}),  # fmt: skip
        },
        "optional": {
            "control_image": ("IMAGE", {"tooltip": "Canny, depth, pose, lineart, HED, MLSD, scribble or grayscale "
                                                   "image; stretched to the output size. First image of a batch."}),
            "inpaint_image": ("IMAGE", {"tooltip": "The image to inpaint; read only together with a mask."}),
            "mask": ("MASK", {"tooltip": "1 marks the region to regenerate (ComfyUI's MASK convention); without one "
                                         "the whole image is generated."}),
        },
    }  # fmt: skip


def _control(handle: ControlHandle, strength, start_percent, end_percent, control_image, inpaint_image, mask):
    if not isinstance(handle, ControlHandle):
        raise ValueError(f"control must come from Qwen21 Load Fun Control, got {type(handle).__name__}")
    return Control(handle.net, float(strength), float(start_percent), float(end_percent), control_image,
                   inpaint_image, mask)  # fmt: skip


class Qwen21ApplyControl:
    """Control and inpainting for Qwen21 Sampler: a control image (canny, depth, pose, ...) steers the picture; a mask
    with an inpaint image regenerates only the masked region. The branch's prefix is computed once per prompt, its
    steps replay from CUDA graphs like the plain ones; steps outside start/end cost what plain steps cost."""

    CATEGORY = "Qwen21/control"
    DESCRIPTION = __doc__
    RETURN_TYPES = (MODEL_TYPE, "MODEL")
    RETURN_NAMES = ("model", "MODEL")
    OUTPUT_TOOLTIPS = ("The model with control, for Qwen21 Sampler; the input model is unchanged.",
                       "The same as ComfyUI's MODEL, for KSampler (None outside ComfyUI).")  # fmt: skip
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return _control_inputs(MODEL_TYPE, "From a Qwen21 loader or Qwen21 Load LoRA.")

    def apply(self, model, control, strength, start_percent, end_percent, control_image=None, inpaint_image=None,
              mask=None):  # fmt: skip
        spec = _control(control, strength, start_percent, end_percent, control_image, inpaint_image, mask)
        controlled = model.with_control(spec, control.weights)
        return (controlled, controlled.comfy_model)


class Qwen21ApplyControlModel:
    """Control and inpainting on a Qwen21 MODEL for KSampler and ComfyUI's other samplers (after ComfyUI's LoRA loaders,
    say): the same branch as Qwen21 Apply Fun Control. The control image is encoded with the model's own VAE."""

    CATEGORY = "Qwen21/control"
    DESCRIPTION = __doc__
    RETURN_TYPES = ("MODEL",)
    RETURN_NAMES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The MODEL with control; the input MODEL is unchanged.",)
    FUNCTION = "apply"

    @classmethod
    def INPUT_TYPES(cls):
        return _control_inputs("MODEL", "A MODEL from a Qwen21 loader (after LoRA loaders too).")

    def apply(self, model, control, strength, start_percent, end_percent, control_image=None, inpaint_image=None,
              mask=None):  # fmt: skip
        spec = _control(control, strength, start_percent, end_percent, control_image, inpaint_image, mask)
        if not host.IN_COMFYUI:
            raise RuntimeError("Qwen21 Apply Fun Control (MODEL) works on ComfyUI's MODEL, inside ComfyUI; outside it "
                               "use Qwen21 Apply Fun Control on the QWEN21_MODEL")  # fmt: skip
        from .comfy.control import with_control  # inside ComfyUI only

        return (with_control(model, spec, control.weights),)
