"""Scheduler node: the released Qwen-Image-2.1 schedule (its resolution shift and terminal stretch) or a turbo
checkpoint's few-step sigmas, as ComfyUI SIGMAS for SamplerCustomAdvanced and the other custom sampling nodes."""

from __future__ import annotations

from ..qwen21_core.config import QWEN21_SCHEDULER
from ..qwen21_core.request import LATENT_SCALE
from ..qwen21_core.scheduler import partial_schedule

MAX_SIDE = 8192  # pixels: a value through a link is held to the widget's range (a width of 10**6 overflowed)
SCHEDULES = ("released", "turbo")
MAX_STEPS = 200  # as Qwen21 Sampler's steps widget


def _pipeline_of(model):
    """Our pipeline behind a MODEL from a Qwen21 loader; None for another MODEL (native ComfyUI's, say)."""
    return getattr(getattr(model, "model", None), "pipe", None)


class Qwen21Scheduler:
    """The sigmas Qwen-Image-2.1 was released with, for ComfyUI's custom samplers (SamplerCustomAdvanced + euler
    gives what Qwen21 Sampler gives). KSampler's own schedulers cannot shift by resolution: on our MODEL its
    `simple` equals the released schedule at 1024x1024 except the last steps' terminal stretch (see the help)."""

    CATEGORY = "Qwen21"
    DESCRIPTION = __doc__
    RETURN_TYPES = ("SIGMAS",)
    RETURN_NAMES = ("sigmas",)
    OUTPUT_TOOLTIPS = ("steps + 1 falling sigmas ending in 0, for SamplerCustomAdvanced / SamplerCustom.",)
    FUNCTION = "get_sigmas"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL", {"tooltip": "From a Qwen21 loader (its checkpoint's schedule and turbo sigmas), or "
                                    "native ComfyUI's Qwen-Image-2.1 model (the released schedule)."}),  # fmt: skip
                "schedule": (
                    list(SCHEDULES),
                    {"default": "released", "tooltip": "released: the shifted schedule over `steps`, as the "
                     "reference pipeline samples. turbo: the checkpoint's own few-step sigmas (its model_index.json "
                     "`sample_sigmas`; `steps` is ignored); an error if it has none."},  # fmt: skip
                ),
                "steps": ("INT", {"default": 40, "min": 1, "max": MAX_STEPS, "tooltip": "Denoising steps."}),
                "width": ("INT", {"default": 1024, "min": 64, "max": MAX_SIDE, "step": 32,
                                  "tooltip": "The image's width: the shift grows with its pixels."}),  # fmt: skip
                "height": ("INT", {"default": 1024, "min": 64, "max": MAX_SIDE, "step": 32,
                                   "tooltip": "The image's height."}),  # fmt: skip
                "denoise": ("FLOAT", {"default": 1.0, "min": 0.01, "max": 1.0, "step": 0.01,
                                      "tooltip": "Below 1: the last part of a longer schedule, as KSampler's denoise "
                                      "(for a start latent)."}),  # fmt: skip
            },
            "optional": {
                "latent": ("LATENT", {"tooltip": "If connected, its size replaces width and height."}),
            },
        }

    def get_sigmas(self, model, schedule, steps, width, height, denoise, latent=None):
        if latent is not None:
            samples = latent["samples"]
            height, width = samples.shape[-2] * LATENT_SCALE, samples.shape[-1] * LATENT_SCALE
        if width % 32 or height % 32 or min(width, height) < 64 or max(width, height) > MAX_SIDE:
            raise ValueError(f"width and height must be multiples of 32 from 64 to {MAX_SIDE}, got {width}x{height}")
        pipe = _pipeline_of(model)
        config = pipe.scheduler_config if pipe is not None else QWEN21_SCHEDULER
        base = None
        if schedule == "turbo":
            base = pipe.pipeline_config.sample_sigmas if pipe is not None else None
            if not base:
                raise ValueError("schedule 'turbo' needs a turbo checkpoint's sample_sigmas (its model_index.json, "
                                 "loaded with Qwen21 Load Diffusers Folder); this model has none: use "
                                 "'released'")  # fmt: skip
        elif schedule != "released":
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        tokens = (height // LATENT_SCALE) * (width // LATENT_SCALE)
        sigmas, _timesteps = partial_schedule(config, tokens, steps, denoise, list(base) if base else None)
        return (sigmas,)
