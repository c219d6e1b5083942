"""One ComfyUI sampling run on our MODEL (KSampler, SamplerCustom, any guider): what happens around it, and its state.

Around the run (ComfyUI's OUTER_SAMPLE wrapper, before its memory manager loads the DiT): a pending negative prompt is
encoded only when the guidance will use it (cfg other than 1, or a guider of another kind), so the text encoder is
placed before the DiT and never displaces it mid-run.

The run's state (`SamplingRun`: whether it is guided, the rows of a call, the VelocityRun with its branches) lives in
the run's own copy of the model options (`transformer_options[RUN_KEY]`), which ComfyUI hands to every model call of
that run and to no other: nothing of a run is kept on the shared diffusion module.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ...qwen21_core.errors import stable_name
from ...qwen21_core.memory.planner import same_device
from ...qwen21_core.request import LATENT_SCALE
from ...qwen21_core.velocity import Part, VelocityRun
from .conditioning import PendingNegative, resolve_pending
from .control import RUN_CONTROL_SIZING, ControlOption, adopt_native_control, control_option, run_control_sizing

log = logging.getLogger(__name__)

SAMPLING_WRAPPER_KEY = "qwen21"
RUN_KEY = "qwen21_run"


@stable_name
class DiffusionModelPlacementError(RuntimeError):
    """The DiT is not on the device it runs on when a model call comes (something moved it off mid-run)."""


def uses_negative(guider) -> bool:
    """Whether the guider will ask for conditionings other than the positive: a CFG guider at cfg 1 does not
    (ComfyUI skips the uncond there unless a node disabled that), any other guider with more conditionings may."""
    others = [name for name in getattr(guider, "conds", {}) if name != "positive"]
    if not others:
        return False
    cfg = getattr(guider, "cfg", None)
    if not isinstance(cfg, (int, float)):
        return True
    return not math.isclose(cfg, 1.0) or bool(guider.model_options.get("disable_cfg1_optimization", False))


def sampling_wrapper(executor, noise, latent_image, sampler, sigmas, *args, **kwargs):
    """ComfyUI's OUTER_SAMPLE wrapper: runs before the models load, ends after the run, whatever ends it."""
    guider = executor.class_obj
    guided = uses_negative(guider)
    if guided:
        for name, entries in guider.conds.items():
            if name != "positive":
                for entry in entries:
                    resolve_pending(entry)
    run = SamplingRun(guided=guided, rows=int(noise.shape[0]))
    options = guider.model_options.setdefault("transformer_options", {})  # this run's own copy (CFGGuider.sample)
    adopt_native_control(guider, options)
    prepare_control(guider, options, noise.shape[-2:])
    sampling = guider.model_patcher.get_model_object("model_sampling")
    sizing = RUN_CONTROL_SIZING.set(run_control_sizing(control_option(options), sampling))
    options[RUN_KEY] = run
    try:
        return executor(noise, latent_image, sampler, sigmas, *args, **kwargs)
    finally:
        RUN_CONTROL_SIZING.reset(sizing)
        options.pop(RUN_KEY, None)
        stats = run.close()
        if stats:
            control = stats.get("control", "off")
            control = "" if control == "off" else f", control {control}"
            log.info("qwen21: %d model calls, %d prefix computations, %d replayed steps, prefix cache %s, decode "
                     "graphs %s, peak %.2f GiB%s", stats.get("steps", 0), stats.get("prefills", 0),
                     stats.get("replayed_steps", 0), stats.get("prefix_cache"), stats.get("decode_graph"),
                     stats.get("peak_vram_mib", 0) / 1024, control)  # fmt: skip


def prepare_control(guider, transformer_options: dict, latent_size) -> None:
    """Encode a control's images for this run's size before the DiT loads (the VAE placed first, so it never displaces
    the DiT mid-run); the pipeline keeps the context for the model calls."""
    option = control_option(transformer_options)
    if option is None or not option.control.on:
        return
    model = guider.model_patcher.model
    model.load_vae()
    model.pipe.control_context(option.control, tuple(int(n) for n in latent_size))


@dataclass
class SamplingRun:
    """guided: the run plans for a second (negative) branch; rows: the latent rows of one conditioning's call."""

    guided: bool
    rows: int
    velocity_run: VelocityRun | None = None
    pipe: object = None

    def velocity(self, pipe, x: torch.Tensor, timestep: torch.Tensor, chunks: list, roles: list[str],
                 options, control: ControlOption | None = None) -> torch.Tensor:  # fmt: skip
        """The velocity of ComfyUI's batch `x` (one chunk of rows per conditioning, in order); with `control`, through
        the control branch where the call's sigma lies in its range."""
        for cond in chunks:
            if isinstance(cond, PendingNegative):
                raise ValueError("Qwen21 MODEL: the sampler asked for the negative prompt, which was not encoded "
                                 "because the guidance did not seem to use it (cfg 1). Set cfg above 1, or use a "
                                 "CONDITIONING without a pending negative (ConditioningZeroOut)")  # fmt: skip
        check_placed(pipe)
        rows = x.shape[0] // len(chunks)
        spec = None if control is None or not control.control.on else control.control
        if self.velocity_run is None:
            self.pipe = pipe
            self.velocity_run = pipe.velocity_run(chunks[0], x.shape[-2] * LATENT_SCALE, x.shape[-1] * LATENT_SCALE,
                                                  max(self.rows, rows), self.guided, options, spec)  # fmt: skip
        parts = [Part(cond, role, rows) for cond, role in zip(chunks, roles, strict=True)]
        if spec is None or not control.active(float(timestep.reshape(-1)[0])):
            return self.velocity_run.velocity(x, timestep, parts)
        context = pipe.control_context(spec, tuple(x.shape[-2:]))
        return self.velocity_run.velocity(x, timestep, parts, spec, context)

    def close(self) -> dict:
        """End the run (its branches released, its graph entries kept for the next run); its stats."""
        run, self.velocity_run = self.velocity_run, None
        if run is None:
            return {}
        run.close()
        return dict(self.pipe.last_sample_stats)


def check_placed(pipe) -> None:
    """The DiT samples on the device it was loaded for, never silently elsewhere: with part of its blocks streaming
    it is still there (its non-block weights are); moved off entirely, it is an error at once."""
    wanted, where = pipe.execution_device, pipe.transformer.device
    if wanted.type == "cuda" and not same_device(where, wanted):
        raise DiffusionModelPlacementError(
            f"Qwen21 MODEL: the diffusion model is on {where}, not on {wanted} where it samples: another model was "
            "loaded after it within this sampling run and ComfyUI moved it off. Run again; if it happens again, "
            "report the workflow (the nodes between the loader and the sampler)"
        )
