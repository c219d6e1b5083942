"""Shared pytest setup: GPU tests skip on machines without CUDA, saying why."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (run on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
