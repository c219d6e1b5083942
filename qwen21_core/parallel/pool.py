"""Rank 0's worker processes: started once per loaded model, one per extra device, and stopped with it.

The process that loaded the model (ComfyUI's own, inside ComfyUI) stays rank 0: it runs the sampler loop and drives
the workers with small commands over a channel each (channel.py); latents, velocities and the all-to-alls go over
the process group (group.py). Workers are plain `python` processes of the same interpreter, in their own session (a
Ctrl+C in ComfyUI's terminal does not reach them), that exit when rank 0's channel closes.

Errors: a worker that fails reports it at once (its rank, the kind, the message, its traceback). A reader thread on
rank 0 collects the reports and is the watchdog: on a failure, a worker process that exits, or a step that makes no
progress within the timeout, it aborts rank 0's collectives (NCCL) and tells the other workers to abort theirs, so
nothing waits forever. The run then ends with a `ParallelError` naming the rank that failed first; every worker
stays up (one that died or stopped answering is restarted and loads its DiT again), and the next run starts by
forming a fresh process group.

Only one pool per process (torch.distributed's default group is per process): a pool started while another is
running stops the other first.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from multiprocessing.connection import wait
from pathlib import Path

import torch

from .. import settings
from ..errors import stable_name
from . import group
from .channel import (
    HANDSHAKE_TIMEOUT_S,
    TRUSTED_FUNCTIONS_ENV,
    Failure,
    HandshakeError,
    accept,
    listen,
    python_command,
    receive,
    send,
    trusted_functions,
)
from .jobs import JobSpec, KeptBranches, ParallelJob
from .worker import ADDRESS_ENV, AUTHKEY_ENV, RANK_ENV

log = logging.getLogger(__name__)

# The package as rank 0 imported it: a worker registers it under the same name, so pickled recipes resolve.
PACKAGE_NAME = __name__.removesuffix(".qwen21_core.parallel.pool")
PACKAGE_FOLDER = str(Path(__file__).resolve().parents[2])
REPORT_GRACE_S = 5.0  # after rank 0's collective fails, how long to wait for the worker's report of the cause
WATCH_INTERVAL_S = 0.2


@stable_name
class ParallelError(RuntimeError):
    """A rank of a multi-device run failed. Says which rank and why; the next run works again."""

    def __init__(self, failure: Failure, starting: bool = False):
        hint = ""
        if failure.kind == "out of memory":
            hint = " Lower the output size, the batch or the reference images, use fp8 weights or K/V, or parallel off."
        if starting:
            what, after = "starting the workers", "The workers were stopped; load the model again."
        elif failure.kind in ("process exited", "timeout"):
            what, after = "multi-GPU sampling", "The worker is restarted (and loads its DiT again) before the next run."
        else:
            what, after = "multi-GPU sampling", "Every worker stays up; the next run rebuilds the process group."
        super().__init__(f"{what} failed on {failure.describe()}.{hint} {after}")
        self.failure = failure


_ACTIVE: list[WorkerPool] = []  # at most one


@atexit.register
def _stop_all() -> None:
    for pool in list(_ACTIVE):
        pool.shutdown()


class _Worker:
    """Rank 0's view of one worker process."""

    def __init__(self, rank: int, device: torch.device):
        self.rank, self.device = rank, device
        self.process: subprocess.Popen | None = None
        self.connection = None
        self.replies: queue.Queue = queue.Queue()
        self.info: dict = {}
        self._send_lock = threading.Lock()  # the main thread and the watchdog both send

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def reachable(self) -> bool:
        return self.connection is not None and not self.connection.closed

    def send(self, *message) -> bool:
        """Send if the channel is open; False if it is closed or closes now (the process died: on record)."""
        with self._send_lock:
            if not self.reachable:
                return False
            try:
                send(self.connection, *message)
            except OSError:
                return False
        return True


def _exit_code(process: subprocess.Popen | None) -> int | None:
    """The exit code of a process whose channel just closed (it may take a moment to be reaped)."""
    if process is None:
        return None
    try:
        return process.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return None


def worker_python_path() -> str:
    """Rank 0's import roots for a worker, without the current folder ('') and without the pack's own folder: the
    bootstrap registers the pack by its folder, and as a root that folder's kernels/ would shadow PyPI's `kernels`."""
    own = Path(PACKAGE_FOLDER)
    return os.pathsep.join(path for path in sys.path if path and Path(path).resolve() != own)


class WorkerPool:
    """Workers on `devices` (ranks 1..N) beside rank 0 on `device`, each with the DiT `recipe` builds."""

    def __init__(self, devices, recipe, device, *, backend: str | None = None, timeout_s: float | None = None,
                 load_timeout_s: float | None = None):  # fmt: skip
        self.device = torch.device(device)
        self.workers = [_Worker(rank, torch.device(d)) for rank, d in enumerate(devices, start=1)]
        if not self.workers:
            raise ValueError("a worker pool needs at least one device besides rank 0's")
        self.recipe = recipe
        self.world = 1 + len(self.workers)
        self.backend = backend or group.backend_for([self.device] + [w.device for w in self.workers])
        if self.backend == "nccl" and not torch.distributed.is_nccl_available():
            raise RuntimeError("several GPUs need PyTorch with NCCL (its Linux CUDA builds); this one has none")
        self.timeout_s = timeout_s or settings.current().parallel_timeout_s
        self.load_timeout_s = load_timeout_s or settings.current().parallel_load_timeout_s
        self.kept = KeptBranches()  # rank 0's sequence-parallel caches kept for a rerun (the workers keep theirs)
        self.generation = 0
        self.broken = True  # no group yet
        self.closed = False
        self.failure: Failure | None = None  # the first failure of the current run
        self.busy_since: float | None = None  # when rank 0 entered the current step (the watchdog's clock)
        self.running = False  # a run is in progress (a failure then aborts every rank's collectives)
        self._lock = threading.Lock()
        self._authkey = secrets.token_bytes(32)
        self._listener = listen()
        self._proven: queue.Queue = queue.Queue()  # connections whose handshake succeeded (_accept_one)
        self._store = group.host_store(self.timeout_s)
        self._reader: threading.Thread | None = None

    @property
    def devices(self) -> list[torch.device]:
        return [self.device] + [w.device for w in self.workers]

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"group {self.generation}" + (" (to rebuild)" if self.broken else "")
        return f"WorkerPool({self.backend}, ranks on {[str(d) for d in self.devices]}, {state})"

    # ---- start and stop ------------------------------------------------------------------------------------

    @classmethod
    def start(cls, devices, recipe, device, **kwargs) -> WorkerPool:
        """Start the workers, load their DiTs and form the process group (stopping another pool first)."""
        for other in list(_ACTIVE):
            log.info("stopping the workers of the previous model (one multi-GPU model at a time)")
            other.shutdown()
        pool = cls(devices, recipe, device, **kwargs)
        _ACTIVE.append(pool)
        try:
            started = time.perf_counter()
            pool._spawn(pool.workers)  # all at once: each imports torch and reads its DiT in parallel
            pool._load(pool.workers)
            pool._reader = threading.Thread(target=pool._read, name="qwen21-pool-watchdog", daemon=True)
            pool._reader.start()
            pool._regroup()
            log.info("%r ready in %.1f s", pool, time.perf_counter() - started)
        except ParallelError as error:
            pool.shutdown()
            raise ParallelError(error.failure, starting=True) from None
        except BaseException:
            pool.shutdown()
            raise
        return pool

    def _spawn(self, workers: list[_Worker]) -> None:
        """Start these workers' processes and take their channels as they connect (each says its rank first). Each
        child's environment is this process's plus what its start needs (worker.py reads it)."""
        host, port = self._listener.getsockname()
        for worker in workers:
            env = dict(os.environ)
            env.update({
                ADDRESS_ENV: f"{host}:{port}",
                AUTHKEY_ENV: self._authkey.hex(),
                RANK_ENV: str(worker.rank),
                TRUSTED_FUNCTIONS_ENV: trusted_functions(self.recipe),  # a FunctionRecipe's builder, for its messages
                "PYTHONPATH": worker_python_path(),
                group.NCCL_ERROR_HANDLING: "0",  # our watchdog, not torch's, ends a failed run (group.py)
                **group.loopback_sockets(),  # gloo and NCCL listen on the loopback interface only (one host)
            })  # fmt: skip
            worker.process = subprocess.Popen(python_command(PACKAGE_NAME, PACKAGE_FOLDER), env=env,
                                              start_new_session=True)  # fmt: skip
            worker.connection = None
            worker.replies = queue.Queue()
        by_rank = {worker.rank: worker for worker in workers}
        deadline = time.monotonic() + self.load_timeout_s
        while any(worker.connection is None for worker in workers):
            connection = self._accept_one(workers, deadline)
            if not connection.poll(HANDSHAKE_TIMEOUT_S):
                connection.close()
                raise RuntimeError(f"a worker process connected but sent nothing in {HANDSHAKE_TIMEOUT_S:.0f} s")
            message = receive(connection)
            kind, rank = (message + (None,))[:2]
            if kind != "hello" or rank not in by_rank or by_rank[rank].connection is not None:
                connection.close()
                raise RuntimeError(f"a worker process sent {kind!r} for rank {rank} as its first message")
            by_rank[rank].connection = connection

    def _accept_one(self, workers: list[_Worker], deadline: float):
        """The next connection that proves the key; fails if a worker that has not connected exits first, or at the
        deadline. Each connection proves itself on a thread of its own (HANDSHAKE_TIMEOUT_S each), so connections
        that stay silent (any local process can connect) hold up neither the others nor the accepting."""
        waiting = [worker for worker in workers if worker.connection is None]
        while all(worker.alive for worker in waiting) and time.monotonic() < deadline:
            try:
                return self._proven.get_nowait()
            except queue.Empty:
                pass
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._prove, args=(sock, peer), name="qwen21-handshake", daemon=True).start()
        dead = [worker for worker in waiting if not worker.alive]
        if dead:
            worker = dead[0]
            raise RuntimeError(f"worker rank {worker.rank} ({worker.device}) did not start: its process exited with "
                               f"code {worker.process.poll()}; see its log lines above")  # fmt: skip
        raise RuntimeError(f"worker ranks {[w.rank for w in waiting]} did not connect within "
                           f"{self.load_timeout_s:.0f} s ({settings.PARALLEL_LOAD_TIMEOUT})")  # fmt: skip

    def _prove(self, sock, peer) -> None:
        try:
            self._proven.put(accept(sock, self._authkey))
        except HandshakeError as error:
            log.warning("dropped a connection to the worker channel from %s: %s", peer, error)

    def _load(self, workers: list[_Worker]) -> None:
        """Every worker builds its DiT (at once), then says so."""
        for worker in workers:
            worker.send("load", self.recipe, str(worker.device), self._store.port, self.world, self.backend,
                        self.timeout_s)  # fmt: skip
        for worker in workers:
            worker.info = self._await(worker, self.load_timeout_s, "loading its DiT", direct=self._reader is None)[1]

    def shutdown(self) -> None:
        """Stop every worker and leave the group. Idempotent; also runs at interpreter exit."""
        if self.closed:
            return
        self.closed = True
        for worker in self.workers:
            worker.send("shutdown")
        for worker in self.workers:
            if worker.process is None:
                continue
            try:
                worker.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            if worker.connection is not None:
                worker.connection.close()
        self.kept.clear()
        group.leave()
        self._store = None  # closes its listening socket
        self._listener.close()
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        log.info("stopped the workers on %s", [str(w.device) for w in self.workers])

    # ---- the reader thread: replies, failures, the watchdog ----------------------------------------------------

    def _read(self) -> None:
        """The watchdog thread: it must outlive anything that goes wrong in one round, or every later failure would
        go unnoticed and rank 0 would wait for each reply until its timeout."""
        while not self.closed:
            try:
                self._read_once()
            except Exception as error:  # noqa: BLE001 - reported, and the watch goes on
                log.exception("the multi-GPU watchdog hit an error; it carries on")
                try:
                    self._fail(Failure(0, str(self.device), "watchdog", f"{type(error).__name__}: {error}"))
                except Exception:  # noqa: BLE001 - already logged above
                    pass
                time.sleep(WATCH_INTERVAL_S)

    def _read_once(self) -> None:
        """One round: the replies and failure reports that arrived, then the progress check."""
        connections = {w.connection: w for w in self.workers if w.reachable}
        try:
            ready = wait(list(connections), timeout=WATCH_INTERVAL_S)
        except OSError:  # a connection closed while waiting (a restart or the shutdown)
            return
        for connection in ready:
            worker = connections[connection]
            if connection is not worker.connection:
                continue  # replaced meanwhile (a restart)
            try:
                message = receive(connection)
            except (EOFError, OSError):
                if not self.closed and connection is worker.connection:
                    connection.close()
                    code = _exit_code(worker.process)
                    self._fail(Failure(worker.rank, str(worker.device), "process exited",
                                       f"the worker process ended (exit code {code})"))  # fmt: skip
                continue
            except Exception as error:  # noqa: BLE001 - an unreadable message: the channel is out of step
                if not self.closed and connection is worker.connection:
                    connection.close()  # the worker is restarted before the next run
                    self._fail(Failure(worker.rank, str(worker.device), type(error).__name__,
                                       f"rank 0 could not read its message: {error}"))  # fmt: skip
                continue
            if message[0] == "error":
                self._fail(message[1])
            else:
                worker.replies.put(message)
        busy = self.busy_since
        if busy is not None and time.monotonic() - busy > self.timeout_s and self.failure is None:
            self._fail(Failure(0, str(self.device), "timeout", f"a step made no progress in {self.timeout_s:.0f} "
                               f"s (set {settings.PARALLEL_TIMEOUT} to wait longer)"))  # fmt: skip

    def _fail(self, failure: Failure) -> None:
        """Record the first failure of a run and make every rank stop waiting on the others."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = failure
        if first:
            log.error("multi-GPU run: %s", failure.describe())  # the worker logged its traceback
        else:
            log.info("multi-GPU run, after the first failure: %s", failure.describe())
        self.broken = True
        if self.running:
            self._abort_all()

    def _abort_all(self) -> None:
        group.abort()
        for worker in self.workers:
            worker.send("abort")

    def _await(self, worker: _Worker, timeout_s: float, what: str, direct: bool = False) -> tuple:
        """The worker's next reply; a ParallelError if it fails first, exits or says nothing within the timeout.
        direct: read the channel here (before the reader thread runs)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if direct:
                try:
                    message = receive(worker.connection) if worker.connection.poll(WATCH_INTERVAL_S) else None
                except (EOFError, OSError):
                    code = _exit_code(worker.process)
                    why = f"the worker process ended (exit code {code}) while {what}"
                    raise ParallelError(Failure(worker.rank, str(worker.device), "process exited", why)) from None
                if message is not None and message[0] == "error":
                    raise ParallelError(message[1])
                if message is not None:
                    return message
            else:
                try:
                    return worker.replies.get(timeout=WATCH_INTERVAL_S)
                except queue.Empty:
                    pass
                failure = self.failure
                if failure is not None and failure.rank == worker.rank:
                    raise ParallelError(failure)
            if time.monotonic() > deadline:
                raise ParallelError(Failure(worker.rank, str(worker.device), "timeout",
                                            f"no answer within {timeout_s:.0f} s while {what}"))  # fmt: skip

    # ---- the process group -----------------------------------------------------------------------------------

    def _regroup(self) -> None:
        """Form a fresh process group with every worker (restarting any that died or stopped answering)."""
        self.kept.clear()  # every rank starts the new group with nothing kept
        self.failure = None
        lost = [worker for worker in self.workers if not worker.alive or not worker.reachable]
        if lost:
            self._restart(lost)
        self.generation += 1
        for worker in self.workers:
            while not worker.replies.empty():  # stale replies of the failed run
                worker.replies.get_nowait()
            worker.send("join", self.generation)
        try:
            group.join(self._store, self.generation, 0, self.world, self.backend, self.device, self.timeout_s)
        except Exception as error:
            if self.failure is not None:  # a worker could not join: its report says why
                raise ParallelError(self.failure) from error
            raise
        for worker in self.workers:
            self._await(worker, self.timeout_s, "joining the process group")
        self.broken = False

    def _restart(self, workers: list[_Worker]) -> None:
        log.warning("restarting worker rank(s) %s", [worker.rank for worker in workers])
        for worker in workers:
            if worker.alive:
                worker.process.kill()
                worker.process.wait()
            old, worker.connection = worker.connection, None  # the reader lets go of it first
            if old is not None:
                old.close()
        self._spawn(workers)
        self._load(workers)

    # ---- runs -----------------------------------------------------------------------------------------------

    def run(self, transformer, spec: JobSpec, graphs=None) -> PoolRun:
        """Start one conditioning's run on every rank; rank 0's part runs here, in the caller's loop."""
        if self.closed:
            raise RuntimeError("this model's workers were stopped (another multi-GPU model was loaded since); load "
                               "this model again to use several GPUs")  # fmt: skip
        if self.broken:
            self._regroup()
        self.failure = None
        self.running = True
        self.send_all("job", spec)
        return PoolRun(self, transformer, spec, graphs)

    def send_all(self, *message) -> None:
        """To every worker whose channel is open (one that closed has died: its failure is on record)."""
        for worker in self.workers:
            worker.send(*message)

    def inject_fault(self, rank: int, where: str = "in_block", kind: str = "error") -> None:
        """Make worker `rank` fail once during the next step (for tests and the benchmark's recovery check)."""
        self.workers[rank - 1].send("fault", where, kind)

    def release(self) -> None:
        """Free the kept caches and decode graphs on every rank (weights stay)."""
        self.kept.clear()
        if self.closed or self.broken:
            return
        self.send_all("release")
        for worker in self.workers:
            self._await(worker, self.timeout_s, "releasing its caches")

    @property
    def idle_cache_bytes(self) -> int:
        return self.kept.nbytes


class PoolRun:
    """Rank 0's handle on one run: each `step` commands the workers, then does rank 0's part of the same step;
    `close` ends the run on every rank (always call it, also after an error)."""

    def __init__(self, pool: WorkerPool, transformer, spec: JobSpec, graphs):
        self.pool, self.spec = pool, spec
        self.job: ParallelJob | None = None
        self.cut_short = False  # a step (or the setup) raised on rank 0: the other ranks may be waiting on it
        self.worker_stats: list[dict] = []
        try:
            self.job = ParallelJob(transformer, spec, 0, pool.world, graphs, pool.kept)
        except BaseException:
            self.cut_short = True
            self.close()
            raise

    def step(self, x: torch.Tensor, t: torch.Tensor, first: bool) -> list[torch.Tensor]:
        pool = self.pool
        pool.send_all("step", first)
        pool.busy_since = time.monotonic()
        try:
            velocities = self.job.step(x, t, first)
            if x.device.type == "cuda" and pool.failure is None:
                # NCCL work is asynchronous: wait for it here, where the watchdog's clock runs (and an aborted
                # step's garbage is never used: the failure is checked right after)
                torch.cuda.synchronize(x.device)
        except BaseException as error:
            self.cut_short = True
            raise self._explain(error) from error
        finally:
            pool.busy_since = None
        if pool.failure is not None:
            self.cut_short = True
            raise ParallelError(pool.failure)
        return velocities

    def _explain(self, error: BaseException) -> BaseException:
        """Rank 0's step failed: a worker's report of the cause (if it comes within a few seconds), else rank 0's
        own error (its collectives may be what failed, or rank 0 itself)."""
        pool = self.pool
        deadline = time.monotonic() + REPORT_GRACE_S
        is_collective = isinstance(error, RuntimeError) and not isinstance(error, torch.OutOfMemoryError)
        while is_collective and pool.failure is None and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL_S / 4)
        if pool.failure is not None:  # a worker's report, or the watchdog's (rank 0: no progress)
            return ParallelError(pool.failure)
        return error

    def close(self) -> dict:
        """End the run on every rank; returns rank 0's stats with the workers' (`workers`, one dict each). After a
        failure nothing of the run is kept and, if a step was cut short, the group is torn down first so that no
        rank waits on it; a worker that does not answer is restarted before the next run."""
        pool = self.pool
        failed = self.cut_short or pool.failure is not None
        stats = self.job.close(keep=not failed) if self.job is not None else {}
        if failed:
            if pool.failure is None:
                pool.failure = Failure(0, str(pool.device), "stopped", "rank 0 stopped the run mid-step")
            pool.broken = True
            pool._abort_all()
            group.leave()  # gloo: peers blocked on rank 0 get an error now
        pool.send_all("end")
        for worker in pool.workers:
            try:
                self.worker_stats.append(pool._await(worker, pool.timeout_s, "ending the run")[1])
            except ParallelError as error:
                log.warning("rank %d did not end the run (%s); restarting it before the next run", worker.rank,
                            error.failure.describe())  # fmt: skip
                if worker.alive:
                    worker.process.kill()
                pool.broken = True
        pool.running = False
        if pool.failure is not None and not self.cut_short:
            # every step completed on every rank (their collectives pair up), so the result stands
            log.warning("a worker failed while ending the run (%s); the result is complete", pool.failure.describe())
        stats["workers"] = self.worker_stats
        return stats
