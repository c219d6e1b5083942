"""Load PyTorch's own CUDA kernels, the ones a first prompt launches, before a prompt comes.

CUDA loads a kernel's code into the process the first time the process launches it. On a restart with every Triton
kernel on disk, the first image's encode still left the GPU idle for 249 ms of its 321 ms and the first prefill for
189 ms, against 16 and 42 ms in the next prompt: ops such as a dtype cast, an add or an rsqrt took 10-35 ms each the
first time, the process loading their kernels (torch.profiler over the first two prompts, BENCHMARKS "Session").
Which model runs them does not matter, only which kernels launch, so tiny modules of the same classes launch them
here, in a background thread, from ComfyUI's start (nodes/__init__.py), while ComfyUI starts and the loader reads the
files:
- a text-only prompt through a tiny Qwen3-VL (text/kernel_warmup.py `text_prompt_priming`);
- the flash attention variants the encoder and the prefill pick (sdpa.py `prime_flash_kernels`);
- the DiT's timestep embedding, text projection and prefix scatter (dit/kernel_warmup.py `prime_entry_ops`).
Our Triton kernels are not here: the pipeline's warm-up loads them for the model's own shapes (qwen21_core/warmup.py).
With it the first encode after a restart took 0.253-0.393 s instead of 0.388-0.605 s, and the first image 1.23x its
steady image in the median of five restarts instead of 1.32x (the two packages alternating, BENCHMARKS "Session").

It runs only where CUDA is already initialised (ComfyUI does so before it loads custom nodes), on the current device:
priming never creates a CUDA context a user did not ask for (ComfyUI with --cpu). Once per process and device;
QWEN21_KERNEL_WARMUP=0 turns it off with the warm-up. A failure is logged and changes nothing else: the first prompt
then loads the kernels itself.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from .warmup import warmup_enabled

log = logging.getLogger(__name__)

_started: dict[int, threading.Thread] = {}
_lock = threading.Lock()


def prime_before_first_prompt() -> None:
    """What the pack starts when its node classes are imported (ComfyUI's start), each in a background thread and
    each on its own conditions: Triton's cache key (kernels/_triton.py `prime_compile_key`) and torch's CUDA kernels
    (`prime_cuda_kernels`). A failure of either is logged and leaves the other running."""
    from ..kernels._triton import prime_compile_key

    for name, start in (("Triton's cache key", prime_compile_key), ("CUDA kernels", prime_cuda_kernels)):
        try:
            start()
        except Exception:  # noqa: BLE001 - an optimisation only; never a reason for the pack to fail
            log.debug("%s not primed", name, exc_info=True)


def priming_steps():
    """(name, function of (device, dtype)) in the order they run, the encoder's first, as a prompt needs them. Made on
    the caller's thread, with every import they need (text/kernel_warmup.py says why)."""
    from .dit.kernel_warmup import prime_entry_ops
    from .sdpa import prime_flash_kernels
    from .text.kernel_warmup import text_prompt_priming

    return [("text prompt", text_prompt_priming()), ("flash attention", prime_flash_kernels),
            ("DiT entry", prime_entry_ops)]  # fmt: skip


def prime_cuda_kernels(device: torch.device | None = None) -> threading.Thread | None:
    """Start the priming thread for `device` (default: the current CUDA device) unless it ran or runs already, or CUDA
    is not initialised, or the warm-up is off. Returns the thread (joinable), or None where nothing runs."""
    if not warmup_enabled() or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    with _lock:
        if index in _started:
            return _started[index]
        steps = priming_steps()
        thread = threading.Thread(target=_prime, args=(torch.device("cuda", index), steps),
                                  name="qwen21-cuda-priming", daemon=True)  # fmt: skip
        _started[index] = thread
    thread.start()
    return thread


def _prime(device: torch.device, steps) -> None:
    # the thread's own stream: nothing here waits for, or holds up, work another thread queued on the default stream
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        run_steps(device, steps)
        torch.cuda.current_stream(device).synchronize()


def run_steps(device: torch.device, steps, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Run each (name, step) on `device`; a step that fails is logged and the others still run. -> the failures."""
    started = time.perf_counter()
    failed = []
    for name, step in steps:
        try:
            step(device, dtype)
        except Exception as error:  # noqa: BLE001 - priming never fails anything; the first prompt loads them
            failed.append(f"{name} ({type(error).__name__}: {error})")
    if failed:
        log.warning("CUDA kernel priming on %s: %s failed; the first prompt loads those kernels itself", device,
                    "; ".join(failed))  # fmt: skip
    log.info("CUDA kernels primed on %s in %.2f s", device, time.perf_counter() - started)
    return failed
