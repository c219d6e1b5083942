"""Fun-Control on our MODEL, for KSampler and ComfyUI's other samplers. Imported only inside ComfyUI.

`with_control` clones the MODEL and puts a `ControlOption` in its transformer options (ComfyUI hands them to every
model call of a run) and the branch's patcher among its additional models (ComfyUI loads it beside the DiT). The
option's start and end are sigmas from the MODEL's own model sampling (`percent_to_sigma`), as native's node has
them; a call is controlled when its sigma lies between them. The context (the control image encoded) is made before
the run loads the DiT (nodes/comfy/sampling.py), so the VAE never displaces the DiT mid-run.
"""

from __future__ import annotations

import weakref
from contextvars import ContextVar
from dataclasses import dataclass

from ...qwen21_core.control import Control

CONTROL_KEY = "qwen21_control"  # in transformer_options
ADDITIONAL_MODELS_KEY = "qwen21_control"
NATIVE_MODELS_KEY = "qwen21_native_fun_control"  # our copy of a native Fun ControlNet's weights
_converted = weakref.WeakKeyDictionary()  # native module -> our ControlHandle of its weights
SIGMA_TOLERANCE = 1e-6


@dataclass(frozen=True, eq=False)
class ControlOption:
    """control: the Fun-Control to run; sigma_start >= sigma_end: the sigmas between which a call is controlled."""

    control: Control
    sigma_start: float
    sigma_end: float

    def __deepcopy__(self, memo):  # ComfyUI deep-copies model options at every clone: the weights are shared
        return self

    def active(self, sigma: float) -> bool:
        return self.control.on and self.sigma_end - SIGMA_TOLERANCE <= sigma <= self.sigma_start + SIGMA_TOLERANCE


def with_control(model, control: Control, weights):
    """A clone of our MODEL `model` that runs `control` (weights: the branch's ManagedModules, whose patcher ComfyUI
    loads with the DiT)."""
    from .model import Qwen21ComfyModel

    if not isinstance(getattr(model, "model", None), Qwen21ComfyModel):
        raise ValueError("Qwen21 Apply Fun Control (MODEL): the MODEL must come from a Qwen21 loader (through "
                         "ComfyUI's LoRA loaders too); for native ComfyUI's Qwen-Image-2.1 use its own "
                         "QwenImage21FunControlNetApply")  # fmt: skip
    clone = model.clone()
    sampling = clone.get_model_object("model_sampling")
    option = ControlOption(control, float(sampling.percent_to_sigma(control.start)),
                           float(sampling.percent_to_sigma(control.end)))  # fmt: skip
    clone.model_options.setdefault("transformer_options", {})[CONTROL_KEY] = option
    if weights.patcher is not None:
        clone.set_additional_models(ADDITIONAL_MODELS_KEY, [weights.patcher])
    return clone


def control_option(transformer_options: dict) -> ControlOption | None:
    option = (transformer_options or {}).get(CONTROL_KEY)
    return option if isinstance(option, ControlOption) else None


# (control layers, plain branch beside) of the run ComfyUI is preparing: set by our OUTER_SAMPLE wrapper around the run
# (nodes/comfy/sampling.py), read by the MODEL's memory_required, which ComfyUI calls with shapes only
RUN_CONTROL_SIZING: ContextVar[tuple[int, bool]] = ContextVar("qwen21_run_control_sizing", default=(0, False))


def run_control_sizing(option: ControlOption | None, sampling) -> tuple[int, bool]:
    """(control layers, plain branch beside) of a run with `option` (ours, or native's taken over), for job_bytes: a
    range inside the schedule (`sampling`: the MODEL's model sampling) keeps a plain branch beside the controlled
    one."""
    if option is None or not option.control.on:
        return 0, False
    inside = (option.sigma_start < float(sampling.percent_to_sigma(0.0)) - SIGMA_TOLERANCE
              and option.sigma_end > float(sampling.percent_to_sigma(1.0)) + SIGMA_TOLERANCE)  # fmt: skip
    return len(option.control.net.control_blocks), inside


def _native_control_patch(patch):
    """The native Fun-Control patch behind a block replacement, or None (duck-typed on what native's classes hold)."""
    control_patch = getattr(patch, "control_patch", None)
    wanted = ("model_patch", "strength", "sigma_start", "sigma_end", "control_image", "inpaint_image", "mask")
    return control_patch if control_patch is not None and all(hasattr(control_patch, a) for a in wanted) else None


def adopt_native_control(guider, transformer_options: dict) -> None:
    """Native QwenImage21FunControlNetApply's patches in this run's options become our ControlOption (see the module
    docstring); the run's options are its own copy, the MODEL's stay as they are."""
    replaced = (transformer_options.get("patches_replace") or {}).get("dit") or {}
    found = {}
    for key, patch in list(replaced.items()):
        control_patch = _native_control_patch(patch)
        if control_patch is None:
            continue
        found[id(control_patch)] = control_patch
        if patch.previous is None:
            del replaced[key]
        else:
            replaced[key] = patch.previous
    if not found:
        return
    if len(found) > 1 or control_option(transformer_options) is not None:
        raise ValueError("Qwen21 MODEL: more than one Fun ControlNet on this MODEL; our DiT runs one at a time")
    (native,) = found.values()
    for wrappers in ((transformer_options.get("wrappers") or {}).get("diffusion_model") or {}).values():
        wrappers[:] = [w for w in wrappers if getattr(w, "__self__", None) is not native]  # its prepare() too
    handle = _converted_weights(native.model_patch, guider.model_patcher.model.pipe)
    control = Control(handle.net, float(native.strength), image=native.control_image,
                      inpaint_image=native.inpaint_image, mask=native.mask)  # fmt: skip
    transformer_options[CONTROL_KEY] = ControlOption(control, float(native.sigma_start), float(native.sigma_end))
    if handle.weights.patcher is not None:
        guider.model_patcher.set_additional_models(NATIVE_MODELS_KEY, [handle.weights.patcher])


def _converted_weights(model_patch, pipe):
    """Our branch holding the weights of native's module (once per module: the weights do not change)."""
    from ...qwen21_core.checkpoints.loading import fun_control_from_state_dict
    from .. import host
    from ..control import ControlHandle

    module = model_patch.model
    handle = _converted.get(module)
    if handle is None:
        net = fun_control_from_state_dict(module.state_dict(), pipe.transformer.config, host.offload_device(),
                                          pipe.dtype, "native ComfyUI's Fun ControlNet")  # fmt: skip
        handle = ControlHandle(net, "native Fun ControlNet", pipe.execution_device)
        _converted[module] = handle
    return handle
