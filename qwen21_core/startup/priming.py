"""Priming: load what a first prompt needs from PyTorch and Triton themselves, in background threads, while a model
loads (its files are read meanwhile).

Two things, each in a thread of its own, once per process (and device):
- Triton's cache key of its own installation (`prime_triton_cache_key`). The first compile of a process, a cache hit
  too, hashes Triton's compiler sources and its library (hundreds of megabytes) to key its cache (`triton_key`, computed
  once). On a restart that hash stood on the first image's critical path (a profile of the first prompt shows it) before
  any kernel loaded from disk; hashlib releases the interpreter's lock while it hashes, so a thread can do it.
- PyTorch's own CUDA kernels, the ones a first prompt launches (`prime_torch_kernels`). CUDA loads a kernel's code
  into the process the first time the process launches it. On a restart with every Triton kernel on disk, the first
  image's encode and prefill still left the GPU idle for most of their time, where the next prompt's did not: ops
  such as a dtype cast, an add or an rsqrt were slow the first time (torch.profiler over the first two prompts shows
  it). Which model runs them does not matter, only which kernels launch, so tiny modules of the same classes launch
  them:
  - a text-only prompt through a tiny Qwen3-VL (text/kernel_warmup.py `text_prompt_priming`);
  - the flash attention variants the encoder and the prefill pick (sdpa.py `prime_flash_kernels`);
  - the DiT's timestep embedding, text projection and prefix scatter (dit/kernel_warmup.py `prime_entry_ops`).
  With it the first encode and the first image after a restart come closer to the steady ones (bench_session's
  restarts measure it).
Our own Triton kernels are not primed here: the kernel warm-up compiles or loads them for the model's own shapes once
the model is loaded (warmup.py, model_warmup.py).

When: `prime(device)` runs when a model starts loading on a CUDA device (pipeline.py `from_pretrained`), never at the
pack's import, which starts no thread. Before, the pack's import started it, so inside ComfyUI it ran while ComfyUI
itself started and was long done when a prompt came. The trade-off: now it runs beside the first load instead, which
reads gigabytes from disk for seconds while priming is shorter, so it is normally done before the first encode; its
steps are made on the loading thread first (briefly: every import happens there, see `priming_steps`). A process that
never loads a model (ComfyUI started for other models) primes nothing and creates no CUDA context.
QWEN21_KERNEL_WARMUP=0 turns it off with the warm-up. A failure is logged and changes nothing else: the first prompt
then loads those kernels itself.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ...kernels._triton import INTERPRETER_ACTIVE, TRITON_AVAILABLE, triton_key_function
from .streams import STARTUP, side_stream
from .warmup import warmup_enabled

log = logging.getLogger(__name__)

_started: dict[int, threading.Thread] = {}  # device index -> its torch-kernel priming thread
_triton_key: threading.Thread | None = None
_lock = threading.Lock()


def prime(device: torch.device) -> None:
    """What a model's load starts first, for the CUDA device it loads to: Triton's cache key and torch's kernels, each
    in a background thread and on its own conditions. A failure of either is logged and leaves the other running."""
    if device.type != "cuda" or not warmup_enabled() or not torch.cuda.is_available():
        return
    starts = {"Triton's cache key": prime_triton_cache_key, "CUDA kernels": lambda: prime_torch_kernels(device)}
    for name, start in starts.items():
        try:
            start()
        except Exception:  # noqa: BLE001 - an optimisation only; never a reason for a load to fail
            log.debug("%s not primed", name, exc_info=True)


def prime_triton_cache_key() -> threading.Thread | None:
    """Start hashing Triton's installation in a background thread, once per process. Nothing without Triton or CUDA
    (nothing to compile), or under the interpreter; a failure only costs the hash later. Returns the thread."""
    global _triton_key
    with _lock:
        if _triton_key is not None or not TRITON_AVAILABLE or INTERPRETER_ACTIVE or not torch.cuda.is_available():
            return _triton_key
        key = triton_key_function()
        if key is None:
            return None

        def run():
            try:
                key()
            except Exception as error:  # noqa: BLE001 - Triton's first compile computes it then
                log.debug("Triton's cache key was not computed ahead (%s: %s)", type(error).__name__, error)

        _triton_key = threading.Thread(target=run, name="qwen21-triton-key", daemon=True)
    _triton_key.start()
    return _triton_key


def priming_steps():
    """(name, function of (device, dtype)) in the order they run, the encoder's first, as a prompt needs them. Made on
    the caller's thread, with every import they need: an import in the priming thread racing one of the main thread's
    could deadlock Python's import locks (text/kernel_warmup.py)."""
    from ..dit.kernel_warmup import prime_entry_ops
    from ..sdpa import prime_flash_kernels
    from ..text.kernel_warmup import text_prompt_priming

    return [("text prompt", text_prompt_priming()), ("flash attention", prime_flash_kernels),
            ("DiT entry", prime_entry_ops)]  # fmt: skip


def prime_torch_kernels(device: torch.device | None = None) -> threading.Thread | None:
    """Start the priming thread for CUDA `device` (default: the current one) unless it ran or runs already, or CUDA is
    not available, or the warm-up is off. Returns the thread (joinable), or None where nothing runs."""
    if (device is not None and device.type != "cuda") or not warmup_enabled() or not torch.cuda.is_available():
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
    # on the device's start-up stream: nothing here waits for, or holds up, work another thread queued on the default
    # stream
    stream = side_stream(device, STARTUP)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        run_steps(device, steps)
        stream.synchronize()


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
