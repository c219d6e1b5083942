"""A worker process: one extra device's rank. It builds the DiT from rank 0's recipe, joins the process group and
then runs what rank 0 commands (pool.py), step by step, until told to shut down or until rank 0 goes away.

Two threads: the main one runs commands in order; a listener reads the channel, queues commands and acts at once on
"abort" (ending a blocked NCCL collective when another rank failed) and on the channel closing (rank 0 died: exit).
A failure in a command is reported to rank 0 with its traceback; the worker then leaves the process group (so that
peers blocked on it get an error at once rather than at the timeout), drops the run and waits for the next command:
it stays usable, and rank 0 rebuilds the group before the next run.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

import torch

from .. import settings
from ..dit.decode_graphs import DecodeGraphs
from ..lora.merge import LoraMerger, layer_shapes, originals_for
from ..lora.reading import read_lora
from . import group
from .channel import TRUSTED_FUNCTIONS_ENV, Failure, connect, receive, send, trust_functions
from .jobs import JobSpec, KeptBranches, ParallelJob
from .wire import MessageError

log = logging.getLogger(__name__)

ADDRESS_ENV = "QWEN21_WORKER_ADDRESS"  # host:port of rank 0's channel listener
AUTHKEY_ENV = "QWEN21_WORKER_AUTHKEY"  # hex
RANK_ENV = "QWEN21_WORKER_RANK"

FAULTS = ("before_step", "in_block")  # where an injected fault strikes (tests, and the benchmark's recovery check)
FAULT_KINDS = ("error", "oom", "exit")


def main() -> None:
    rank = int(os.environ[RANK_ENV])
    # The module's part of the logger name only: inside ComfyUI the package's name is its folder's path.
    logging.basicConfig(level=logging.INFO, format=f"[qwen21 worker rank {rank}] %(levelname)s %(module)s: %(message)s")
    host, port = os.environ[ADDRESS_ENV].rsplit(":", 1)
    connection = connect((host, int(port)), bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    trust_functions(os.environ.get(TRUSTED_FUNCTIONS_ENV, ""))
    torch.set_grad_enabled(False)
    Worker(connection, rank).run()


class Worker:
    def __init__(self, connection, rank: int):
        self.connection, self.rank = connection, rank
        self.commands: queue.Queue = queue.Queue()
        self.device = torch.device("cpu")
        self.transformer = self.graphs = self.merger = self.store = None
        self.world, self.backend, self.timeout_s = 0, "gloo", settings.Settings.parallel_timeout_s  # until on_load
        self.kept = KeptBranches()
        self.loras: dict[str, object] = {}  # LoRA identity -> LoraFile read here
        self.job: ParallelJob | None = None
        self.fault: tuple[str, str] | None = None

    # ---- threads ----------------------------------------------------------------------------------------

    def listen(self) -> None:
        while True:
            try:
                message = receive(self.connection)
            except (EOFError, OSError):  # rank 0 is gone: nobody will ever command this process again
                group.abort()
                os._exit(0)
            except MessageError as error:  # reported by the main thread, which owns the replies
                message = ("bad_message", str(error))
            if message[0] == "abort":
                group.abort()
            else:
                self.commands.put(message)

    def run(self) -> None:
        send(self.connection, "hello", self.rank)
        threading.Thread(target=self.listen, name="qwen21-worker-listener", daemon=True).start()
        while True:
            kind, *args = self.commands.get()
            if kind == "shutdown":
                self.job = None
                self.kept.clear()
                group.leave()
                return
            try:
                getattr(self, f"on_{kind}")(*args)
            except BaseException as error:  # noqa: BLE001 - every failure goes to rank 0; the worker carries on
                self.failed(error)

    def failed(self, error: BaseException) -> None:
        failure = Failure.from_exception(self.rank, str(self.device), error)
        log.error("%s\n%s", failure.describe(), failure.details)
        send(self.connection, "error", failure)
        group.abort()
        group.leave()  # peers blocked on this rank (gloo) get an error now, not at the timeout
        if self.job is not None:
            self.job.close(keep=False)
            self.job = None
        self.kept.clear()
        if self.graphs is not None:
            self.graphs.end_generation()

    # ---- commands -----------------------------------------------------------------------------------------

    def on_load(self, recipe, device: str, store_port: int, world: int, backend: str, timeout_s: float) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.world, self.backend, self.timeout_s = world, backend, timeout_s
        self.transformer = recipe.build(self.device)
        self.graphs = DecodeGraphs(self.transformer)
        self.merger = LoraMerger(self.transformer, originals_for(recipe.source_path))
        self.store = group.connect_store(group.LOOPBACK, store_port, timeout_s)
        weights = sum(p.numel() * p.element_size() for p in self.transformer.parameters())
        log.info("DiT on %s: %s, %.2f GiB of weights", self.device, self.transformer.quantization, weights / 2**30)
        send(self.connection, "ready", {"device": str(self.device), "weights_bytes": weights,
                                        "quantization": self.transformer.quantization})  # fmt: skip

    def on_join(self, generation: int) -> None:
        self.job = None
        self.kept.clear()  # a new group starts with nothing kept, on every rank
        group.join(self.store, generation, self.rank, self.world, self.backend, self.device, self.timeout_s)
        send(self.connection, "joined", generation)

    def on_job(self, spec: JobSpec) -> None:
        self._apply_loras(spec.loras)
        self.transformer.compile_blocks(spec.compile_blocks)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        graphs = self.graphs if spec.decode_graphs and self.device.type == "cuda" else None
        self.job = ParallelJob(self.transformer, spec, self.rank, self.world, graphs, self.kept)

    def on_step(self, first: bool) -> None:
        if self.job is None:
            return  # the run failed here already; rank 0 ends it
        self._strike("before_step")
        self._strike("in_block")
        self.job.step(None, None, first)

    def on_end(self) -> None:
        stats = {"failed": self.job is None}
        if self.job is not None:
            stats |= self.job.close(keep=True)
            self.job = None
        if self.graphs is not None:
            stats["decode_graph"] = self.graphs.describe()
            self.graphs.end_generation()
        if self.device.type == "cuda":
            stats["peak_vram_bytes"] = torch.cuda.max_memory_allocated(self.device)
        send(self.connection, "done", stats)

    def on_release(self) -> None:
        self.kept.clear()
        if self.graphs is not None:
            self.graphs.clear()
        send(self.connection, "released")

    def on_bad_message(self, why: str) -> None:
        raise MessageError(f"rank 0 sent a message this worker cannot read: {why}")

    def on_fault(self, where: str, kind: str) -> None:
        if where not in FAULTS or kind not in FAULT_KINDS:
            raise ValueError(f"fault must be one of {FAULTS} and kind one of {FAULT_KINDS}, got {where!r}, {kind!r}")
        self.fault = (where, kind)

    # ---- helpers ------------------------------------------------------------------------------------------

    def _apply_loras(self, loras: tuple) -> None:
        stack = []
        for path, identity, strength in loras:
            if identity not in self.loras:
                lora = read_lora(path, layer_shapes(self.transformer))
                if lora.identity != identity:
                    raise RuntimeError(f"LoRA {path} changed on disk since rank 0 read it; load it again")
                self.loras[identity] = lora
            stack.append((self.loras[identity], strength))
        self.merger.apply(stack)
        wanted = {identity for _, identity, _ in loras}
        self.loras = {identity: lora for identity, lora in self.loras.items() if identity in wanted}

    def _strike(self, where: str) -> None:
        """An injected fault, once: raise now (before_step) or inside the last block's next decode (in_block)."""
        if self.fault is None or self.fault[0] != where:
            return
        kind = self.fault[1]
        self.fault = None

        def fail(*_args, **_kwargs):
            if kind == "exit":
                os._exit(17)
            error = torch.OutOfMemoryError if kind == "oom" else RuntimeError
            raise error(f"injected fault ({kind}) on rank {self.rank}")

        if where == "before_step":
            fail()
        block = self.transformer.transformer_blocks[-1]

        def fail_once(*args, **kwargs):
            del block.decode  # back to the class's method
            fail()

        block.decode = fail_once
