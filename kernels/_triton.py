"""The one place that says whether a Triton kernel can run for a tensor, and the plumbing the kernel modules
share (the pixel view of [B, C, H, W] strides, and the per-device self-test results).

Triton is optional (the pack must run where it is missing): without it, or for CPU tensors, every dispatcher uses its
torch reference. CUDA tensors run the compiled kernels. CPU tensors run them through the Triton interpreter when
TRITON_INTERPRET=1 was set before Triton was first imported: Triton decides compiled-or-interpreted when a function is
decorated, its own library functions (tl.sum, tl.cdiv, ...) included, so the variable must be in the environment of the
whole process from its start (the kernel tests run in a child process for this).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable

import torch

from . import settings

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None

TRITON_AVAILABLE = triton is not None
# torch dtype -> Triton dtype, for the kernels' OUT_DTYPE / ACT_DTYPE constexpr arguments
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32} if tl else {}
INTERPRETER_ACTIVE = TRITON_AVAILABLE and settings.triton_interpreter_requested()
log = logging.getLogger(__name__)


def triton_key_function():
    """Triton's (cached) key function, which hashes its installation to key its cache (the start-up primes it:
    qwen21_core/startup/priming.py): triton.runtime.cache has it in 3.6 and 3.8; other releases may keep it in
    triton.compiler.compiler, tried next. None where neither has it."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        try:
            found = getattr(importlib.import_module(module), "triton_key", None)
        except ImportError:
            continue
        if callable(found):
            return found
    return None


def triton_runs_on(device: torch.device) -> bool:
    """True where our kernels can run for tensors on `device`: CUDA, or CPU under the interpreter."""
    if not TRITON_AVAILABLE:
        return False
    if device.type == "cuda":
        return not INTERPRETER_ACTIVE
    return device.type == "cpu" and INTERPRETER_ACTIVE


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids. Plain Python: Triton's `triton.cdiv` is a constexpr function whose host call
    is slow for what it does (it unwraps its arguments), and a DiT block computes a dozen grids per step."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as `triton.next_power_of_2` computes it, without its host cost."""
    return 0 if n == 0 else 1 << (int(n) - 1).bit_length()


def jit(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """`triton.jit`, or the plain function where Triton is missing (then it is never launched).

    do_not_specialize: integer arguments that vary with the prompt or image size (row and token counts). Triton
    otherwise compiles one variant per "divisible by 16" / "equal to 1" class of each integer argument, so a new
    prompt length could cost a compile; a count only bounds loops and masks, so specialising on it gains nothing.
    """

    def wrap(function):
        if not TRITON_AVAILABLE:
            return function
        return triton.jit(function, do_not_specialize=list(do_not_specialize))

    return wrap if fn is None else wrap(fn)


def pixel_strides(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(batch, channel, pixel) strides of [B, C, H, W] with H and W merged into one axis (NCHW and
    channels-last both merge), or None when they cannot be."""
    b, c, h, w = t.stride()
    if t.shape[3] == 1:
        return b, c, h
    if t.shape[2] == 1 or h == w * t.shape[3]:
        return b, c, w
    return None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values everywhere, NaN matching NaN: what the self-tests demand of a kernel against torch."""
    return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())


def _device_key(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:N" of the current device are one
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


_torch_ops_only = threading.local()


@contextlib.contextmanager
def torch_ops_only():
    """In this thread, every self-tested kernel counts as unproven, so its callers use torch's ops. The kernels
    match those ops bit for bit (that is what the self-tests prove), so results do not change; what changes is that
    nothing here waits for, or starts, a compile. For the VAE's first decode while the background warm-up is still
    compiling its kernels (qwen21_core/pipeline.py)."""
    previous = getattr(_torch_ops_only, "active", False)
    _torch_ops_only.active = True
    try:
        yield
    finally:
        _torch_ops_only.active = previous


class SelfTests:
    """Results of a kernel module's self-tests, run once per (check, device, dtype) and kept. A kernel that
    claims bit-identity with torch is used only where its self-test passed on that device."""

    def __init__(self, module: str):
        self.module = module
        self._passed: dict[tuple[str, str, torch.dtype], bool] = {}
        self._locks: dict[tuple[str, str, torch.dtype], threading.Lock] = {}

    def passed(self, check: str, device: torch.device, dtype: torch.dtype, run: Callable[[], bool]) -> bool:
        """The cached result of `run()` (under no_grad) for this check, device and dtype; an exception
        (a compile or launch failure) counts as failed, so callers keep torch's ops."""
        if getattr(_torch_ops_only, "active", False):
            return False
        key = (check, _device_key(device), dtype)
        if key in self._passed:  # the hot path: asked at every VAE conv
            return self._passed[key]
        with self._locks.setdefault(key, threading.Lock()):  # one run per key, also when threads ask at once
            return self._run_once(key, check, device, dtype, run)

    def _run_once(self, key, check, device, dtype, run) -> bool:
        if key not in self._passed:
            try:
                with torch.no_grad():
                    ok = bool(run())
            except Exception as exc:
                log.warning("%s: self-test %s could not run on %s %s: %s", self.module, check, device, dtype, exc)
                ok = False
            if not ok:
                log.info("%s: self-test %s failed on %s %s; torch's ops serve there", self.module, check, device, dtype)
            self._passed[key] = ok
        return self._passed[key]

    @contextlib.contextmanager
    def forced(self, check: str, device: torch.device, dtype: torch.dtype, passed: bool):
        """For benchmarks and tests: treat `check` as `passed` on (device, dtype) for the duration."""
        key = (check, _device_key(device), dtype)
        saved = self._passed.get(key)
        self._passed[key] = passed
        try:
            yield
        finally:
            self._passed.pop(key)
            if saved is not None:
                self._passed[key] = saved

    def clear(self) -> None:
        self._passed.clear()
