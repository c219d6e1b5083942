"""One VRAM budget, read from one place: `--vram-budget` (memory_adapter.set_vram_budget) is the local manager's
budget, and the pipeline of a handle plans everything with it (`pipe.memory`): where its K/V cache goes, the room
checked for the prefix before encoding, and where a LoRA merge keeps its copies of the original weights. Before, the
budget bounded only the weights' placement, and the rest planned with the whole card."""

from __future__ import annotations

import pytest
import torch
from qwen21_nodes.nodes import memory_adapter
from qwen21_nodes.nodes.model import Qwen21Model
from qwen21_nodes.qwen21_core.memory import planner
from qwen21_nodes.qwen21_core.memory.manager import LocalMemoryManager
from qwen21_nodes.qwen21_core.options import SampleOptions
from qwen21_nodes.qwen21_core.pipeline import Qwen21Pipeline
from qwen21_nodes.qwen21_core.request import SampleRequest

GIB = 2**30


@pytest.fixture
def handle(tmp_path_factory, monkeypatch):
    from qwen21_nodes.runner.cli import ensure_tiny_models

    monkeypatch.setattr(memory_adapter, "LOCAL", LocalMemoryManager())
    folder = ensure_tiny_models(tmp_path_factory.getbasetemp() / "tiny_models") / "diffusers" / "qwen_image_2.1_tiny"
    return Qwen21Model(Qwen21Pipeline.from_pretrained(folder, device="cpu", dtype=torch.float32))


def on_a_pretend_gpu(monkeypatch, pipe, fake_cuda_memory):
    """The pipeline's planning as on an 80 GiB card with 60 GiB free (its weights stay on the CPU)."""
    fake_cuda_memory(free=60 * GIB, total=80 * GIB, reserved=0, allocated=0)
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(Qwen21Pipeline, "device", property(lambda self: gpu))
    pipe.execution_device = gpu
    monkeypatch.setattr(planner, "host_free_bytes", lambda: 64 * GIB)


def test_the_runners_budget_is_the_pipelines_one_budget(handle):
    assert handle.pipe.memory is memory_adapter.LOCAL and handle.pipe.vram_budget is None
    memory_adapter.set_vram_budget(6 * GIB)
    assert handle.pipe.vram_budget == 6 * GIB  # nothing to copy or keep in step: read where it is set
    memory_adapter.set_vram_budget(None)
    assert handle.pipe.vram_budget is None


def test_the_budget_bounds_kv_planning_and_the_prefix_check(handle, monkeypatch, fake_cuda_memory):
    pipe = handle.pipe
    on_a_pretend_gpu(monkeypatch, pipe, fake_cuda_memory)
    cond = pipe.encode("a red apple", output_resolution=64)
    monkeypatch.setattr(pipe, "idle_cache_bytes", lambda: 0)
    whole_card = pipe.plan_sampling(cond, SampleRequest(height=64, width=64), SampleOptions())
    assert whole_card.kv_placement == "gpu"
    assert pipe._prefix_budget().free_bytes > 50 * GIB

    memory_adapter.set_vram_budget(GIB // 4)  # less than the planner's headroom: nothing may go on the card
    with pytest.raises(planner.DeviceMemoryError, match="0.25 GiB is available"):
        pipe.plan_sampling(cond, SampleRequest(height=64, width=64), SampleOptions())
    assert pipe._prefix_budget().free_bytes == 0


def test_the_budget_bounds_where_a_lora_merge_keeps_its_copies(handle, monkeypatch):
    seen = []
    monkeypatch.setattr(handle.pipe.loras, "apply", lambda stack, vram_budget=None: seen.append(vram_budget))
    memory_adapter.set_vram_budget(3 * GIB)
    handle.pipe.set_loras(())
    assert seen == [3 * GIB]
