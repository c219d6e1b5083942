"""Launching our Triton kernels without Triton's per-call Python path, once a variant has compiled.

`launch(kernel, grid, *args, **kwargs)` does what `kernel[grid](*args, **kwargs)` does. Triton's own path
(JITFunction.run) binds every argument again, derives the specialisation, looks the variant up, builds launch
metadata and calls the (empty) profiler hook chains, and asks the driver of every pointer whether it is device
memory: per launch, on every call. A quantised DiT block launches several of our kernels, so at small images the
host's launches, not the GPU, bounded the eager quantised step.

Here a launch derives its own variant key from what Triton specialises on (each tensor's dtype and 16-byte
alignment; each integer's class: 1, a multiple of 16, 32- or 64-bit; the constexprs and compile options) and
launches the compiled kernel's launcher directly, pointers passed as integers. A key met for the first time is
compiled (or found in Triton's caches) through Triton's `warmup`, which launches nothing, then launched the same way.
The key is at least as fine as Triton's, so a variant never runs on arguments it was not compiled for.

Pointers passed as integers also skip the launcher's "is this device memory" check. That check fails on memory
allocated inside a CUDA-graph capture under the cudaMallocAsync allocator (ComfyUI's default), the reason decode
graphs were off there (dit/decode_graphs.py).

Rules for call sites: runtime arguments (tensors, sizes, strides) positional; keyword arguments only constexprs and
compile options (num_warps, ...); the grid a tuple. Triton's own path serves where the Triton version is not one
this was written against (`TESTED_TRITON`: the launcher's argument list is an internal of Triton), with
QWEN21_FAST_LAUNCH=0, under the interpreter, and while a launch hook is set (profilers such as proton).
"""

from __future__ import annotations

import logging
import threading

import torch

from . import settings
from ._triton import INTERPRETER_ACTIVE, triton

log = logging.getLogger(__name__)

# Triton versions whose launcher takes every parameter, constexprs included, in signature order after the grid,
# stream, function, metadata and hooks (JITFunction.run's own call of CompiledKernel.run): 3.6 runs the GPU tests
# (tests/test_launch.py); 3.8's JITFunction.run makes the same call (read in its source; CI has no GPU); 3.7
# lies between them
TESTED_TRITON = ((3, 6), (3, 7), (3, 8))
_INT32 = range(-(2**31), 2**31)


def _triton_version() -> tuple[int, int]:
    try:
        major, minor = triton.__version__.split(".")[:2]
        return int(major), int(minor)
    except (AttributeError, ValueError):
        return (0, 0)


def _decide() -> bool:
    if triton is None or INTERPRETER_ACTIVE or not torch.cuda.is_available():
        return False
    wanted = settings.current().fast_launch  # False: Triton's launch path everywhere; True: also on an untested Triton
    if wanted is False:
        return False
    version = _triton_version()
    if wanted is None and version not in TESTED_TRITON:
        log.info("Triton %s: kernels launch through Triton's own path (the direct launch is written against Triton "
                 "%s; %s=1 tries it)", triton.__version__, ", ".join(f"{a}.{b}" for a, b in TESTED_TRITON),
                 settings.FAST_LAUNCH)  # fmt: skip
        return False
    return True


_active: bool | None = None


def fast_launch_active() -> bool:
    """Whether launches skip Triton's per-call path in this process (decided once, at the first launch)."""
    global _active
    if _active is None:
        _active = _decide()
    return _active


def set_fast_launch(active: bool | None) -> None:
    """For benchmarks and tests: force the direct launch on or off (None: decide again from the settings)."""
    global _active
    _active = active


class _Kernel:
    """One JIT function's parameters and its compiled variants, by our key."""

    def __init__(self, fn):
        self.fn = fn
        params = fn.params
        self.names = [p.name for p in params]
        self.constexpr = [bool(p.is_constexpr) for p in params]
        self.defaults = [p.default if p.has_default else None for p in params]
        self.variants: dict[tuple, tuple] = {}  # key -> (compiled kernel, the parameters after the positional ones)


# by id(fn): hashing a JITFunction goes through its cache_key (a lock and a property) at every launch; the entry
# holds the function, so its id is not reused while the entry lives
_kernels: dict[int, _Kernel] = {}
_driver = None


def _stream_and_device():
    global _driver
    if _driver is None:
        _driver = triton.runtime.driver.active
    device = _driver.get_current_device()
    return _driver.get_current_stream(device), device


_runtime_knobs = None


def _hooks_set() -> bool:
    """A launch hook is listening (profilers): it wants Triton's launch metadata, so Triton's path serves."""
    global _runtime_knobs
    if _runtime_knobs is None:
        _runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", False)
    if not _runtime_knobs:
        return True  # no knobs to ask: assume someone may be listening
    enter, leave = _runtime_knobs.launch_enter_hook, _runtime_knobs.launch_exit_hook
    # Triton 3.8 keeps HookChains that are empty when nobody listens; older ones None
    return bool(enter is not None and getattr(enter, "calls", True)) or bool(
        leave is not None and getattr(leave, "calls", True)
    )


def direct_launches() -> bool:
    """Whether every launch through `launch` takes the direct path now: what a CUDA-graph capture under
    cudaMallocAsync needs (dit/decode_graphs.py)."""
    return fast_launch_active() and not _hooks_set()


def launch(fn, grid: tuple, *args, **kwargs):
    """`fn[grid](*args, **kwargs)`, without Triton's per-call path where it is active (see the module docstring)."""
    if not direct_launches() or not isinstance(fn, triton.runtime.JITFunction):
        return fn[grid](*args, **kwargs)
    kernel = _kernels.get(id(fn))
    if kernel is None:
        kernel = _kernels.setdefault(id(fn), _Kernel(fn))
    stream, device = _stream_and_device()
    key, values = variant_key(kernel.constexpr, device, args, kwargs)
    variant = kernel.variants.get(key)
    if variant is None:
        variant = _compile(fn, kernel, key, grid, args, kwargs)
        if variant is None:  # a tensor among the keyword arguments: not for this path
            return fn[grid](*args, **kwargs)
    compiled, tail = variant
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, None, None, None, *values, *tail)  # fmt: skip
    return compiled


def variant_key(constexpr: list[bool], device, args: tuple, kwargs: dict) -> tuple[tuple, list]:
    """(the variant's key, the positional arguments as the launcher takes them). The key holds what Triton
    specialises a compile on, or more: each tensor's dtype and 16-byte alignment (pointers become integers), each
    integer's class (1, a multiple of 16, 32- or 64-bit), the type of a float, bool or None (Triton types them without
    looking at the value), and the value of a constexpr or of anything else. Runs at every launch: kept to one pass
    with no call per argument (a DiT block launches a dozen kernels of up to 20 arguments)."""
    values = []
    key = [device]
    for value, is_constexpr in zip(args, constexpr, strict=False):
        if isinstance(value, torch.Tensor):
            pointer = value.data_ptr()
            values.append(pointer)
            key.append((value.dtype, not pointer & 15))
            continue
        values.append(value)
        kind = type(value)
        if is_constexpr:
            key.append((kind, value))
        elif kind is int:  # its class as one number: 1 / a multiple of 16 / neither, plus its width
            divisibility = 1 if value == 1 else 2 if not value % 16 else 0
            width = 4 if value in _INT32 else 8 if value < 2**63 else 12  # 32-bit, 64-bit, unsigned 64-bit
            key.append(divisibility + width)
        elif value is None or kind is float or kind is bool:
            key.append(kind)
        else:  # a numpy integer, say: its value, so no class of it shares a variant with another
            key.append((kind, value))
    if kwargs:
        key.append(tuple(kwargs.items()))
    return tuple(key), values


_in_flight: dict[tuple[int, tuple], threading.Event] = {}  # (id(fn), key) -> set when that compile ended
_in_flight_lock = threading.Lock()


def _compile(fn, kernel: _Kernel, key: tuple, grid, args, kwargs):
    """Compile (or find) the variant through Triton's warmup, which launches nothing; None when the call does not
    follow the call-site rules. One thread compiles a variant; others meeting it meanwhile wait for that compile.

    Per variant, not per kernel: a lock per kernel made the sampler's first launch of one variant wait behind the
    warm-up threads' compiles of others, and the first image came later than on Triton's own path. Without any, the
    warm-up's threads compiled one variant up to six times at once (Triton has no such guard), each copy taking compile
    time and the interpreter's lock from the compiles the first image waits for (bench_cold_start's compile
    timeline)."""
    if any(isinstance(value, torch.Tensor) for value in kwargs.values()):
        return None
    if len(args) > len(kernel.names):
        raise TypeError(f"{kernel.names}: {len(args)} positional arguments for {len(kernel.names)} parameters")
    token = (id(fn), key)
    while True:
        with _in_flight_lock:
            variant = kernel.variants.get(key)
            if variant is not None:
                return variant
            other = _in_flight.get(token)
            if other is None:
                mine = _in_flight[token] = threading.Event()
                break
        other.wait()  # then found above, or (its compile failed) this thread tries, and meets the error itself
    try:
        compiled = fn.warmup(*args, grid=grid, **kwargs)
        compiled.run  # noqa: B018 - loads the binary (sets compiled.function) on this device
        params = {name: kwargs[name] for name in kernel.names if name in kwargs}
        tail = tuple(params.get(name, kernel.defaults[i]) for i, name in enumerate(kernel.names) if i >= len(args))
        variant = kernel.variants[key] = (compiled, tail)
        return variant
    finally:
        with _in_flight_lock:
            del _in_flight[token]
        mine.set()


def forget_variants() -> None:
    """Drop every cached variant (tests; the compiled kernels stay in Triton's caches)."""
    _kernels.clear()
