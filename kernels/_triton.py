"""The one place that says whether a Triton kernel can run for a tensor.

Triton is optional (DESIGN 4): without it, or for CPU tensors, every dispatcher uses its torch reference.
CUDA tensors run the compiled kernels. CPU tensors run them through the Triton interpreter when
TRITON_INTERPRET=1 was set before Triton was first imported: Triton decides compiled-or-interpreted when a
function is decorated, its own library functions (tl.sum, tl.cdiv, ...) included, so the variable must be
in the environment of the whole process from its start (the kernel tests run in a child process for this).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

TRITON_AVAILABLE = triton is not None
INTERPRETER_ACTIVE = TRITON_AVAILABLE and os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device) -> bool:
    """True where our kernels can run for tensors on `device`: CUDA, or CPU under the interpreter."""
    if not TRITON_AVAILABLE:
        return False
    if device.type == "cuda":
        return not INTERPRETER_ACTIVE
    return device.type == "cpu" and INTERPRETER_ACTIVE


def jit(fn):
    """`triton.jit`, or the plain function where Triton is missing (then it is never launched)."""
    return triton.jit(fn) if TRITON_AVAILABLE else fn


def device_key(device: torch.device | str) -> str:
    """A device's name for caching per-device results ("cuda" and "cuda:N" of the current device are one)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)
