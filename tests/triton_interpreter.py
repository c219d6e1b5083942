"""Running Triton kernel tests on CPU: the interpreter needs TRITON_INTERPRET=1 before Triton is first
imported, which a shared pytest process cannot promise, so a test re-runs its own file in a child process
with it set. Helpers shared by the kernel test files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from qwen21_nodes.kernels import _triton


def kernel_device(monkeypatch, skip_reason: str) -> torch.device:
    """Where the kernels run in this process: CPU under the interpreter, else CUDA; skips elsewhere."""
    if _triton.INTERPRETER_ACTIVE:
        round_bf16_like_the_gpu(monkeypatch)
        return torch.device("cpu")
    if _triton.TRITON_AVAILABLE and torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip(skip_reason)


def round_bf16_like_the_gpu(monkeypatch):
    # Triton's interpreter converts fp32 -> bf16 by truncation and bf16 -> fp32 flushing subnormals; the GPU
    # (and torch) round to nearest even and keep subnormals. Its fp32 -> fp8 e4m3 rounding also loses the
    # carry into the exponent (8.0 becomes 4.0), and its e4m3 -> fp32 reads the NaN patterns (0x7F, 0xFF) as
    # +-480. Route those conversions through torch so the interpreter computes what the GPU computes.
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if not hasattr(interpreter, "_convert_float"):
        pytest.skip("this Triton's interpreter changed; its bf16 casts cannot be made to round like the GPU")
    convert = interpreter._convert_float

    def convert_rounding_bf16(values, src_dtype, dst_dtype, rounding_mode):
        if src_dtype == tl.float32 and dst_dtype == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
            return rounded.view(torch.int16).numpy().view(np.uint16)
        if src_dtype == tl.float32 and dst_dtype == tl.float8e4nv:
            rounded = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.float8_e4m3fn)
            return rounded.view(torch.uint8).numpy()
        if src_dtype == tl.float8e4nv and dst_dtype == tl.float32:
            bits = torch.from_numpy(np.ascontiguousarray(values).view(np.uint8))
            return bits.view(torch.float8_e4m3fn).float().numpy()
        if src_dtype == tl.bfloat16 and dst_dtype == tl.float32:  # the interpreter flushes bf16 subnormals
            bits = torch.from_numpy(np.ascontiguousarray(values).view(np.int16))
            return bits.view(torch.bfloat16).float().numpy()
        return convert(values, src_dtype, dst_dtype, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert_rounding_bf16)


def run_under_interpreter(test_file: str, *pytest_args: str) -> subprocess.CompletedProcess:
    """Re-run a test file in a child pytest with TRITON_INTERPRET=1 (skips inside that child)."""
    if _triton.INTERPRETER_ACTIVE:
        pytest.skip("this is the child process")
    if not _triton.TRITON_AVAILABLE:
        pytest.skip("Triton is not installed; the torch references serve every device")
    path = Path(test_file).resolve()
    child = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, str(path)],
        cwd=path.parents[1],
        env=dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, f"kernel tests failed under TRITON_INTERPRET=1:\n{child.stdout}\n{child.stderr}"
    return child
