"""Fun-Control on our MODEL, for KSampler and ComfyUI's other samplers. Imported only inside ComfyUI.

`with_control` clones the MODEL and puts a `ControlOption` in its transformer options (ComfyUI hands them to every
model call of a run) and the branch's patcher among its additional models (ComfyUI loads it beside the DiT). The
option's start and end are sigmas from the MODEL's own model sampling (`percent_to_sigma`), as native's node has
them; a call is controlled when its sigma lies between them. The context (the control image encoded) is made before
the run loads the DiT (nodes/comfy/sampling.py), so the VAE never displaces the DiT mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...qwen21_core.control import Control

CONTROL_KEY = "qwen21_control"  # in transformer_options
ADDITIONAL_MODELS_KEY = "qwen21_control"
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
