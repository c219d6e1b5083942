"""Kernel warm-up: compile (or load from disk) our Triton kernels in background threads, from the moment a model is
loaded.

The first image in a fresh process used to wait for every Triton kernel to compile on first use, one compile per kernel
and shape, a long wait with an empty Triton cache. `KernelWarmup` compiles them in background threads instead, while the
user is still loading, typing or encoding; which jobs, in which parts, is model_warmup.py's choice, and each model's
jobs are built beside the model (quant/, text/, dit/, vae/ kernel_warmup.py). Triton's compiler releases the GIL for
most of its work, so several threads compile at once. With compiled kernels on disk (a restart) each job only loads
them.

`wait(part)` blocks until a part is done: the sampler waits for the DiT's first part before its first step (a kernel
compiled twice is wasted time; a later M bucket's part is waited for by the launch that needs it, model_warmup.py),
the VAE for its own before a fast decode. It waits in slices of WAIT_SLICE_S and calls the host's interrupt check
(`check_interrupted`, ComfyUI's through nodes/host.py) between them, so Cancel reaches a run that waits for a compile
that hangs. A job that fails is logged and the rest of its part skipped: those kernels then compile on first use, as
before.

What a first image needs before it samples is queued first, the rest once that is done, and no job starts while an
encode runs (`KernelWarmup.paused`): on a restart the jobs mostly run Python, and the first encode and the sampler's
wait were sharing the interpreter's lock with jobs they did not need.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import settings
from .streams import STARTUP, side_stream

log = logging.getLogger(__name__)

MAX_THREADS = 8
WAIT_SLICE_S = 0.1  # how often a wait asks whether the user cancelled


def warmup_enabled() -> bool:
    """QWEN21_KERNEL_WARMUP=0 turns the warm-up off (kernels then compile on first use)."""
    return settings.current().kernel_warmup


def warmup_threads() -> int:
    """The pool's size: QWEN21_KERNEL_WARMUP_THREADS when set, else one thread per core but one (the main thread's),
    at most MAX_THREADS. For comparisons: with compiled kernels on disk the jobs mostly run Python, one thread at a
    time, yet fewer threads did not make a restart's first image sooner."""
    chosen = settings.current().kernel_warmup_threads
    return chosen if chosen is not None else max(1, min(MAX_THREADS, (os.cpu_count() or 2) - 1))


def shared_copy(module: torch.nn.Module, device: torch.device) -> Callable[[], torch.nn.Module]:
    """A function giving one copy of `module` on `device`, made by the first job that asks: the warm-up runs on a
    copy, so the model itself stays free to be loaded, offloaded, streamed or merged with a LoRA meanwhile."""
    copied: list[torch.nn.Module] = []
    lock = threading.Lock()

    def get() -> torch.nn.Module:
        with lock:
            if not copied:
                with torch.inference_mode(False):
                    copied.append(copy.deepcopy(module).to(device))
        return copied[0]

    return get


class KernelWarmup:
    """Runs named parts, each a list of independent jobs, on one thread pool, in two stages: the `first` parts' jobs
    are queued at start, the others' once every first part is done; within a stage in order, and a part is done when
    all its jobs are. Jobs are small (a few compiles each), so the compiles of one part spread over the threads instead
    of queueing behind each other.

    Why stages: the jobs are mostly Python on a restart (their kernels load from disk), and every thread shares the
    interpreter's lock with the main thread. With all parts queued at once, the parts a first image does not need
    before its sampling (the VAE's, an image prompt's) took the lock from the first encode and from the parts the
    sampler waits for. Those parts are needed seconds later, if at all (a first decode does not wait for the VAE's,
    model_warmup.py `vae_kernels`), so they run during the sampling."""

    def __init__(self, parts: dict[str, list[Callable[[], None]]], device: torch.device, threads: int | None = None,
                 first: tuple[str, ...] = (), on_part_done: Callable[[str], None] | None = None,
                 check_interrupted: Callable[[], None] | None = None):  # fmt: skip
        self.device = device
        self.threads = threads or warmup_threads()
        self.jobs = {name: len(jobs) for name, jobs in parts.items()}
        self.seconds: dict[str, float] = {}
        self.failures: dict[str, str] = {}
        self.first = tuple(name for name in parts if name in first)
        self._on_part_done = on_part_done  # called with a part's name once it is done, on the thread that ended it
        self.check_interrupted = check_interrupted  # raises to stop a wait (a cancelled run); None: waits to the end
        self._parts = parts
        self._done: dict[str, threading.Event] = {name: threading.Event() for name in parts}
        self._left = dict(self.jobs)
        self._lock = threading.Lock()
        self._started_at = 0.0
        self._pool: ThreadPoolExecutor | None = None
        # jobs start only while this is set: cleared while the main thread holds `paused()` and nobody `wait()`s
        self._may_start = threading.Event()
        self._may_start.set()
        self._pauses = 0
        self._waiters = 0

    def start(self) -> KernelWarmup:
        if self._started_at:
            return self
        self._started_at = time.perf_counter()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="qwen21-warmup")
        self._queue(self._pool, self.first)
        if all(self._done[name].is_set() for name in self.first):
            self._queue_the_rest()
        return self

    def _queue(self, pool: ThreadPoolExecutor, names) -> None:
        for name in names:
            jobs = self._parts.pop(name)  # the jobs (and the model copies they hold) go once they ran
            if not jobs:
                self._finish(name)
            for job in jobs:
                pool.submit(self._job, name, job)

    def _queue_the_rest(self) -> None:
        """The second stage: every part not queued yet. Runs once (from the first stage's last part, or start)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            self._queue(pool, list(self._parts))
            pool.shutdown(wait=False)  # the threads end when the queue is empty

    @contextlib.contextmanager
    def paused(self):
        """No job starts meanwhile (those running finish): for the first encode, whose Python shares the interpreter's
        lock with every job's. Beside the jobs, a restart's first encode took many times as long as later ones; run
        alone, it is soon done, and the jobs the sampler waits for run after it. A `wait()` meanwhile lets the jobs run
        again, so waiting on a paused warm-up cannot hang."""
        with self._lock:
            self._pauses += 1
            self._update_gate()
        try:
            yield
        finally:
            with self._lock:
                self._pauses -= 1
                self._update_gate()

    def _update_gate(self) -> None:  # under self._lock
        if self._pauses and not self._waiters:
            self._may_start.clear()
        else:
            self._may_start.set()

    def _job(self, name: str, job: Callable[[], None]) -> None:
        self._may_start.wait()
        try:
            if name not in self.failures:  # after a failure the part's kernels compile on first use instead
                stream = side_stream(self.device, STARTUP)  # off the compute stream, one for every job
                with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    job()
                if stream is not None:
                    stream.synchronize()
        except Exception as error:  # noqa: BLE001 - a warm-up never fails a run
            self.failures.setdefault(name, f"{type(error).__name__}: {error}")
            log.warning("kernel warm-up %s failed (%s); its kernels compile on first use instead", name, error)
        finally:
            with self._lock:
                self._left[name] -= 1
                last = self._left[name] == 0
            if last:
                self._finish(name)

    def _finish(self, name: str) -> None:
        self.seconds[name] = round(time.perf_counter() - self._started_at, 3)
        self._done[name].set()
        if name in self.first and all(self._done[first].is_set() for first in self.first):
            self._queue_the_rest()
        failed = f", failed: {self.failures[name]}" if name in self.failures else ""
        log.info("kernel warm-up %s: %d jobs, done %.2f s after the start%s", name, self.jobs[name],
                 self.seconds[name], failed)  # fmt: skip
        if self._on_part_done is not None:
            self._on_part_done(name)

    def wait(self, *names: str) -> float:
        """Block until the named parts (all when none are named) are done; returns the seconds waited. Every
        WAIT_SLICE_S meanwhile, `check_interrupted()` may raise to end the wait (the parts go on)."""
        if not self._started_at:
            return 0.0
        started = time.perf_counter()
        with self._lock:
            self._waiters += 1
            self._update_gate()
        try:
            for name in names or tuple(self.jobs):
                event = self._done.get(name)
                while event is not None and not event.wait(WAIT_SLICE_S):
                    if self.check_interrupted is not None:
                        self.check_interrupted()
        finally:
            with self._lock:
                self._waiters -= 1
                self._update_gate()
        waited = time.perf_counter() - started
        if waited > 0.05:
            log.info("waited %.2f s for the kernel warm-up (%s)", waited, ", ".join(names or self.jobs))
        return waited

    def done(self, name: str) -> bool:
        return self._done[name].is_set()

    def busy(self) -> bool:
        """Whether some part is still running: its threads then take the interpreter from the main thread now and
        then, so wall time measured meanwhile is not the step's own (dit/decode_graphs.py reads CPU time then)."""
        return bool(self._started_at) and not all(event.is_set() for event in self._done.values())

    def finished(self, name: str) -> threading.Event:
        """The event set when part `name` is done (also when one of its jobs failed or was skipped)."""
        return self._done[name]
