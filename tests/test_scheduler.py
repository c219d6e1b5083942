"""Sigmas and timesteps bit-identical to diffusers' FlowMatchEulerDiscreteScheduler."""

import numpy as np
import pytest
import torch
from qwen21_nodes.qwen21_core.config import QWEN21_SCHEDULER, SchedulerConfig
from qwen21_nodes.qwen21_core.scheduler import euler_step, flow_schedule, partial_schedule, resolution_shift

diffusers = pytest.importorskip("diffusers")

TURBO_SIGMAS = [1.0, 0.9375, 0.875, 0.75, 0.625, 0.5, 0.3125, 0.125]
CASES = {
    "dynamic exponential (released)": (QWEN21_SCHEDULER, 4096, dict(steps=40)),
    "dynamic exponential, 512px": (QWEN21_SCHEDULER, 1024, dict(steps=13)),
    "static shift": (SchedulerConfig(shift=3.1), 4096, dict(steps=20)),
    "dynamic linear": (SchedulerConfig(use_dynamic_shifting=True, time_shift_type="linear"), 2304, dict(steps=9)),
    "turbo sample_sigmas": (QWEN21_SCHEDULER, 4096, dict(sigmas=TURBO_SIGMAS)),
}


def _reference(config: SchedulerConfig, seq_len, steps=None, sigmas=None):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    sched = FlowMatchEulerDiscreteScheduler(**config.to_dict())
    c = sched.config
    mu = calculate_shift(
        seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
        c.get("max_shift", 1.15),
    )  # fmt: skip
    grid = sigmas if sigmas is not None else np.linspace(1.0, 1 / steps, steps)
    sched.set_timesteps(sigmas=grid, mu=mu)
    return sched


@pytest.mark.parametrize("name", list(CASES))
def test_sigmas_and_timesteps_are_bit_identical(name):
    config, seq_len, kwargs = CASES[name]
    sigmas, timesteps = flow_schedule(config, seq_len, **kwargs)
    ref = _reference(config, seq_len, **kwargs)
    assert sigmas.dtype == torch.float32 and timesteps.dtype == torch.float32
    assert torch.equal(sigmas, ref.sigmas)
    assert torch.equal(timesteps, ref.timesteps)


def test_released_schedule_ends_at_shift_terminal():
    sigmas, _ = flow_schedule(QWEN21_SCHEDULER, 4096, steps=40)
    assert sigmas[-2].item() == pytest.approx(0.02, abs=1e-6)
    assert sigmas[-1].item() == 0.0
    assert resolution_shift(4096, QWEN21_SCHEDULER) == pytest.approx(0.6935, abs=1e-4)


def test_euler_step_matches_reference_rounding():
    config, seq_len, kwargs = CASES["dynamic exponential (released)"]
    ref = _reference(config, seq_len, **kwargs)
    ref.set_begin_index(0)
    sigmas, _ = flow_schedule(config, seq_len, **kwargs)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 8, generator=g).to(torch.bfloat16)
    x_ref = x.clone()
    for i in range(3):
        v = torch.randn(1, 16, 8, generator=g).to(torch.bfloat16)
        x_ref = ref.step(v, ref.timesteps[i], x_ref, return_dict=False)[0]
        x = euler_step(x, v, sigmas[i], sigmas[i + 1])
        assert x.dtype == torch.bfloat16
        assert torch.equal(x, x_ref)


def test_denoise_takes_the_tail_of_a_longer_schedule():
    full, _ = flow_schedule(QWEN21_SCHEDULER, 1024, steps=20)
    part, timesteps = partial_schedule(QWEN21_SCHEDULER, 1024, steps=10, denoise=0.5)
    assert torch.equal(part, full[-11:])
    assert timesteps.shape == (10,)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(steps=0), "steps must be a positive integer"), (dict(sigmas=[]), "at least one"),
     (dict(sigmas=[1.0, 1.5]), r"in \(0, 1\]"), (dict(steps=10**9), "at most 20000"),
     (dict(sigmas=[0.5] * 100_000), "100000 sigmas.*at most 20000")],
)  # fmt: skip
def test_bad_schedules_are_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        flow_schedule(QWEN21_SCHEDULER, 1024, **kwargs)


def test_the_steps_a_run_takes_are_bounded_before_any_grid_is_built():
    """At most 200 steps run (the Sampler node's maximum); a denoise < 1 slices them from a longer grid, at most
    the 20000 steps of 200 at the node's smallest denoise 0.01."""
    part, _ = partial_schedule(QWEN21_SCHEDULER, 1024, steps=200, denoise=0.01)
    assert part.shape == (201,)
    with pytest.raises(ValueError, match="steps must be .* at most 200"):
        partial_schedule(QWEN21_SCHEDULER, 1024, steps=201, denoise=1.0)
    with pytest.raises(ValueError, match="201 sigmas.*at most 200"):
        partial_schedule(QWEN21_SCHEDULER, 1024, steps=1, denoise=1.0, sigmas=[0.5] * 201)
    with pytest.raises(ValueError, match="denoise 1e-06 .* 2000000 steps"):
        partial_schedule(QWEN21_SCHEDULER, 1024, steps=2, denoise=1e-6)


def test_unsupported_scheduler_options_are_errors():
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        SchedulerConfig(use_karras_sigmas=True)
    with pytest.raises(ValueError, match="keys this pack does not know"):
        SchedulerConfig.from_dict({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 1.0, "bogus": 1})


def test_a_single_step_gives_finite_sigmas():
    """The reference returns NaN here (0/0 in the terminal stretch); we keep the unstretched grid."""
    sigmas, timesteps = flow_schedule(QWEN21_SCHEDULER, 4096, steps=1)
    assert torch.equal(sigmas, torch.tensor([1.0, 0.0])) and torch.equal(timesteps, torch.tensor([1000.0]))


def test_a_config_that_cannot_shift_by_length_is_named():
    from qwen21_nodes.qwen21_core.config import SchedulerConfig

    with pytest.raises(ValueError, match="base_image_seq_len and max_image_seq_len must differ"):
        SchedulerConfig(use_dynamic_shifting=True, base_image_seq_len=512, max_image_seq_len=512)
