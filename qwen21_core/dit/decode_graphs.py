"""Whole-step CUDA-graph decode: capture a decode step once per shape, replay it every step after.

A decode step reads only tensors at fixed addresses: the weights, the branch's K/V cache, its rotary
tables and key mask, plus the step's latents and timestep. So each graph entry OWNS its branch's
cache and tables: a later generation with the same key adopts the entry (its prefill writes the new
prefix into the same buffers, its tables are copied in place) and replays without recapture. Only the
latents and timestep are copied in per step. Replay runs the same kernels as eager decode, so the
outputs are bit-identical (checked on the GPU).

Bookkeeping rules:
- key = (role, batch, prefix length, image layout, target shape, dtype, device, attention backend,
  compiled blocks or not);
- a key met for the first time is captured only when the step is bound by the host's launches. Its first
  generation runs eagerly and times one step: if the host spent at least `launch_bound_share` of the step's wall
  time enqueuing it (small images, quantised blocks: there a replayed step took a fraction of the eager one), the
  next step captures. Otherwise the GPU bounds the step, a graph gains nothing (at 1024^2 eager and replay took the
  same time, turbo images too), and the whole generation stays eager. The verdict is remembered with the key: a later
  generation captures only if it runs the same prompt again (the same prefix id, a new seed: only with the prefix
  cache on, which names a generation's prefix), where the kept graph entry also keeps the prefix K/V for the runs
  after it; a changed prompt that happens to have a length met before stays eager (its capture cost a noticeable
  share of a turbo image and bought nothing). A generation that reached no
  verdict (interrupted, or every timed step deferred) keeps the earlier one. A capture costs a step run before it and
  the capture itself. Two things read as host time and are kept out of the measure:
  - a key's first step carries one-time costs (the process's first launches and lazy library set-up, a new shape's
    first GEMM heuristics and allocations): it is only run, and the key's second step is timed. Timing the first
    made the first image of every process capture a GPU-bound 1024^2 step, and every first 1536^2 image capture;
  - while the background kernel warm-up runs (qwen21_core/startup/warmup.py, `background_busy`) its threads take the
    interpreter now and then: a restart's second step, timed while the VAE's kernels still loaded, captured a
    GPU-bound 1024^2 step, and the capture made the first image slower than the steady one. Then the host's share is
    this thread's CPU time over the step's wall time, which waits for the interpreter do not raise; below the share
    it gives no verdict, and the next step is timed again (on Windows, whose thread clock is coarse, no step is
    timed while the warm-up runs);
- an entry serves one live branch at a time; a second live branch with the same key decodes eagerly
  until the first is released;
- at most `max_entries` entries; the least recently used free entry is evicted (its buffers freed)
  before a new one is created;
- an allocation OOM or any failure while capturing frees the partial buffers, is remembered for that
  key (no retry) and the branch decodes eagerly;
- weights that moved (ComfyUI offloading and reloading the model), and LoRA side paths attached, changed or
  removed, invalidate every entry (a merged LoRA changes weights in place: entries stay).
Every fallback logs its reason once and is reported by `describe()`.

Because an idle entry keeps its cache, re-running the same conditioning (a new seed, say) finds its
prefix K/V already there: the sampler compares `cache.prefix_id` and skips the prefill.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...kernels.launch import direct_launches
from .. import settings
from ..memory.planner import graph_pool_idle_bytes
from ..quant.linear import LowRankSidePath
from ..startup.streams import CAPTURE, side_stream
from .control import control_key
from .kv_cache import KVCacheSpec
from .transformer import Branch, QwenImage21Transformer

log = logging.getLogger(__name__)

PRE_CAPTURE_RUNS = 1  # lazy cuBLAS workspaces and first kernel launches happen here, outside the capture
# a first-seen key captures from the step after its timed one when the host took at least this share of its wall time
LAUNCH_BOUND_SHARE = 0.9
SEEN_KEYS_KEPT = 256  # keys of earlier eager generations remembered (a few hundred tuples)
GPU_BOUND_REASON = (
    "first generation of this shape and prompt length, and the GPU (not the host's launches) "
    "bounds a step: decoded eagerly, captured if the same prompt comes again (a new seed, prefix cache on)"
)
GPU_BOUND_AGAIN_REASON = (
    "the GPU bounds this shape's step and the prompt is not the last one of its length: decoded eagerly (a capture "
    "would cost about a step and gain nothing), captured if the same prompt comes again (prefix cache on)"
)


# Windows counts a thread's CPU time in coarse ticks (the system timer's), too coarse against a step's time: there no
# step is timed while the warm-up runs
THREAD_CLOCK_FINE = sys.platform != "win32"
_MEASURE = object()  # _entry_for's answer for a first-seen key's steps before its verdict: eager, one of them timed


def _prefix_id(branch: Branch):
    """What the branch's prefix holds (set by the sampler with the prefix cache on), or None."""
    return None if branch.cache is None else branch.cache.prefix_id


@dataclass
class _Entry:
    key: tuple
    branch: Branch
    graph: object = None  # torch.cuda.CUDAGraph or a test double
    static_x: torch.Tensor | None = None
    static_t: torch.Tensor | None = None
    static_out: torch.Tensor | None = None
    in_use: bool = False
    replays: int = 0


@dataclass
class _Failed:
    """Marks a key whose capture failed: it is not retried, and takes an LRU slot like an entry."""

    key: tuple
    reason: str
    in_use: bool = False


# Under PyTorch's cudaMallocAsync allocator (ComfyUI's default) memory allocated inside a capture is not yet device
# memory to the driver: Triton's own launch path checks every pointer and fails there, and a failed capture aborts
# the process when its memory is freed. The direct launch (kernels/launch.py) passes pointers unchecked, so a
# capture may start there only while every Triton kernel of the step launches that way, and only for what the GPU
# tests have run that way (resident blocks).
ASYNC_ALLOCATOR_REASON = (
    "PyTorch's cudaMallocAsync allocator is on (ComfyUI's default) and {why}; a failed capture under it aborts the "
    "process, so none is tried (start ComfyUI with --disable-cuda-malloc for CUDA-graph decode)"
)
_OWN_PATH = "Triton's own launch path, which cannot launch on memory allocated inside a capture there"


def async_allocator_blocker(compiled_blocks: bool, streaming: bool) -> str | None:
    """Why a capture may not start under cudaMallocAsync, or None when it may (see ASYNC_ALLOCATOR_REASON)."""
    if compiled_blocks:
        why = f"the blocks are compiled (torch.compile's kernels launch through {_OWN_PATH})"
    elif streaming:
        why = "blocks stream from host RAM (not yet run with graphs under this allocator)"
    elif not direct_launches():
        why = f"this process launches Triton kernels through {_OWN_PATH} (kernels/launch.py says when)"
    else:
        return None
    return ASYNC_ALLOCATOR_REASON.format(why=why)


def cuda_allocator_backend() -> str:
    """The CUDA allocator in use: "native" or "cudaMallocAsync" (ComfyUI's cuda_malloc.py sets the latter)."""
    if not torch.cuda.is_available():
        return "native"
    return torch.cuda.get_allocator_backend()


def weights_signature(transformer: QwenImage21Transformer) -> tuple:
    """What a captured graph reads by address: every parameter's, and the LoRA side paths' factors (with their shapes
    and rows, built into the graph). A change means the graphs must be captured again."""
    side_paths = tuple(m.signature() for m in transformer.modules() if isinstance(m, LowRankSidePath))
    return tuple(p.data_ptr() for p in transformer.parameters()), side_paths


def run_before_capture(run):
    """`run()` PRE_CAPTURE_RUNS times on the device's capture side stream (startup/streams.py), outside any capture
    (lazy set-up, first launches); returns its last result, once the current stream has waited for it."""
    stream = side_stream(torch.device("cuda", torch.cuda.current_device()), CAPTURE)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(PRE_CAPTURE_RUNS):
            result = run()
    torch.cuda.current_stream().wait_stream(stream)
    return result


def capture_graph(run) -> torch.cuda.CUDAGraph:
    """`run()` captured into a new CUDA graph. Thread-local: other threads' CUDA work (the kernel warm-up,
    qwen21_core/startup/; ComfyUI's previews; with several GPUs, the NCCL watchdog's event queries) may go on during
    the capture; only this thread's calls are checked against it."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        run()
    return graph


def cuda_graph_capture(decode, static_x, static_t):
    """Capture `decode(static_x, static_t)` into a CUDA graph. Returns (graph, static output)."""
    out = run_before_capture(lambda: decode(static_x, static_t))
    # The output lives in memory allocated before the capture: under cudaMallocAsync a tensor allocated inside one
    # and freed after it draws a warning from PyTorch at every graph's release
    static_out = torch.empty_like(out)
    del out
    graph = capture_graph(lambda: static_out.copy_(decode(static_x, static_t)))
    return graph, static_out


@dataclass
class DecodeGraphs:
    transformer: QwenImage21Transformer
    max_entries: int = 4
    capture: object = cuda_graph_capture  # swapped in tests
    launch_bound_share: float = LAUNCH_BOUND_SHARE  # 0: capture every key at its first step
    entries: OrderedDict = field(default_factory=OrderedDict)
    # keys earlier generations decoded without an entry -> (their verdict, the prefix they ran: cache.prefix_id)
    seen: OrderedDict = field(default_factory=OrderedDict)
    host_shares: list = field(default_factory=list)  # shares of the current generation's steps that gave a verdict
    reasons: list = field(default_factory=list)  # fallback reasons of the current generation
    replays: int = 0  # steps the current generation replayed (describe() reports this generation, not earlier ones)
    _weights: tuple | None = None
    _logged: set = field(default_factory=set)
    deferred_shares: list = field(default_factory=list)  # steps timed while the warm-up ran, with no verdict
    # True while other threads of this process may take the interpreter (the kernel warm-up, qwen21_core/startup/)
    background_busy: Callable[[], bool] | None = None

    # ---- generation lifetime ----------------------------------------------------------------------

    def _note(self, reason: str):
        if reason not in self.reasons:
            self.reasons.append(reason)
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("decode graphs: %s; decoding eagerly", reason)

    def _check_weights(self):
        signature = weights_signature(self.transformer)
        if self._weights is not None and signature != self._weights and self.entries:
            self._note("weights moved since capture (model offloaded/reloaded): graphs rebuilt")
            self.clear()
        self._weights = signature

    def key_for(self, layout, batch: int, backend: str, role: str, kv: KVCacheSpec | None = None,
                control=None) -> tuple:  # fmt: skip
        tr = self.transformer
        image_layout = tuple((s.start, s.end, s.is_text) for s in layout.segments)
        return (
            role, batch, layout.prefix_len, image_layout, layout.target_shape, tr.dtype, str(tr.device), backend,
            tr.compiled,  # compiled and eager block code are different graphs
            kv or KVCacheSpec(), tr.streaming_signature(),  # the cache and the streamed blocks are in the graph
            control_key(control),  # a controlled step runs the control blocks too
            settings.current().gguf_prefetch,  # a GGUF step's fills on a second stream are in its graph
        )  # fmt: skip

    def new_branch(self, layout, batch: int, backend: str = "auto", role: str = "positive",
                   kv: KVCacheSpec | None = None, control=None) -> Branch:  # fmt: skip
        """A branch for this generation: an idle captured entry's (adopted) or a fresh one. control: a Fun-Control
        (control.py Control) the branch runs beside its blocks; an entry keeps its control state (cache, context
        buffer) as it keeps the base's."""
        self._check_weights()
        key = self.key_for(layout, batch, backend, role, kv, control)
        entry = self.entries.get(key)
        if isinstance(entry, _Entry) and not entry.in_use:
            self._adopt(entry, layout)
            self.entries.move_to_end(key)
            return entry.branch
        try:
            branch = self.transformer.new_branch(layout, batch, backend, kv, control=control)
        except torch.OutOfMemoryError:
            self._evict_idle(keep=0)
            branch = self.transformer.new_branch(layout, batch, backend, kv, control=control)
        branch.graph_key = key
        return branch

    def _adopt(self, entry: _Entry, layout):
        fresh = self.transformer.new_branch_tables(layout)
        branch = entry.branch
        for name in ("target_cos", "target_sin"):
            getattr(branch, name).copy_(getattr(fresh, name))
        if branch.decode_key_mask is not None:
            branch.decode_key_mask.copy_(fresh.decode_key_mask)
        branch.layout = layout
        branch.prefix_cos, branch.prefix_sin = fresh.prefix_cos, fresh.prefix_sin
        branch.prefix_masks = fresh.prefix_masks
        branch.prefix_key_valid = fresh.prefix_key_valid
        entry.in_use = True  # the cache keeps its prefix and `prefix_id`: the sampler may reuse it

    def release(self, branch: Branch):
        """End of a generation for this branch: an entry keeps its buffers; others are freed."""
        key = getattr(branch, "graph_key", None)
        entry = self.entries.get(key)
        if isinstance(entry, _Entry) and entry.branch is branch:
            entry.in_use = False
            return
        if key is not None:
            # a generation with no verdict (interrupted before its timed step, or every step deferred while the
            # warm-up ran) keeps the one an earlier generation reached
            verdict = branch.first_sight or self.seen.get(key, (None, None))[0]
            self.seen[key] = (verdict, _prefix_id(branch))
            self.seen.move_to_end(key)
            while len(self.seen) > SEEN_KEYS_KEPT:
                self.seen.popitem(last=False)
        branch.release()

    def end_generation(self):
        """Mark every entry idle and forget this generation's fallback reasons (after `describe`)."""
        for entry in self.entries.values():
            entry.in_use = False
        self.reasons.clear()
        self.host_shares.clear()
        self.deferred_shares.clear()
        self.replays = 0

    def clear(self):
        for entry in self.entries.values():
            if isinstance(entry, _Entry):
                entry.branch.release()
        self.entries.clear()
        self.seen.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def idle_cache_bytes(self) -> int:
        """Device bytes the idle entries hold, in their K/V caches and in their graphs' private pools (the free
        estimate leaves those out): memory a new generation gets back, by adopting the entry (same key) or by
        evicting it (an allocation that runs out evicts idle entries and retries)."""
        idle = [e for e in self.entries.values() if isinstance(e, _Entry) and not e.in_use]
        caches = sum(e.branch.cache_bytes for e in idle)
        pools = graph_pool_idle_bytes(self.transformer.device) if idle else {}
        return caches + sum(pools.get(tuple(e.graph.pool()), 0) for e in idle if hasattr(e.graph, "pool"))

    def describe(self) -> str:
        replays = self.replays
        shares = f" (host share of a new key's step: {', '.join(f'{s:.2f}' for s in self.host_shares)})"
        waited = self.deferred_shares
        deferred = (f" (no verdict in {len(waited)} steps while the kernel warm-up ran, host CPU shares "
                    f"{min(waited, default=0):.2f}-{max(waited, default=0):.2f})")  # fmt: skip
        text = "replay" if replays else "off"
        if self.reasons:
            text = ("replay, " if replays else "off: ") + "; ".join(self.reasons) + (shares if self.host_shares else "")
        return text + (deferred if self.deferred_shares else "")

    # ---- decode -----------------------------------------------------------------------------------

    def __call__(self, branch: Branch, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        entry = self._entry_for(branch)
        if entry is _MEASURE:
            return self._step_before_verdict(branch, x, t)
        if entry is None:
            return self.transformer.decode(branch, x, t)
        entry.static_x.copy_(x)
        entry.static_t.copy_(t)
        entry.graph.replay()
        entry.replays += 1
        self.replays += 1
        return entry.static_out.clone()

    def _eligible(self, branch) -> str | None:
        if torch.compiler.is_compiling():
            return "inside torch.compile tracing"
        if self.capture is cuda_graph_capture and self.transformer.device.type != "cuda":
            return "the model is not on CUDA"
        if cuda_allocator_backend() == "cudaMallocAsync":  # checked before any capture: a failed one kills
            control = getattr(branch, "control", None)
            streaming = bool(self.transformer.streaming_signature()) or (
                control is not None and bool(control.net.streaming_signature()))  # fmt: skip
            return async_allocator_blocker(self.transformer.compiled, streaming)
        return None

    def _entry_for(self, branch: Branch):
        """The branch's entry (captured now if due), None (decode eagerly) or _MEASURE (a timed eager step)."""
        key = getattr(branch, "graph_key", None)
        if key is None:
            return None
        entry = self.entries.get(key)
        if isinstance(entry, _Entry):
            if entry.branch is branch:
                return entry
            self._note("another live generation holds this shape's graph")
            return None
        if isinstance(entry, _Failed):
            self._note(entry.reason)
            return None
        reason = self._eligible(branch)
        if reason is not None:
            self._note(reason)
            return None
        if self.launch_bound_share > 0:  # (a share of 0 captures every key at once)
            decision = self._capture_decision(key, branch)
            if decision is not True:
                return decision
        return self._capture_new(key, branch)

    def _capture_decision(self, key, branch: Branch):
        """For a key with no entry: True (capture now), None (decode eagerly) or _MEASURE (time a step first)."""
        verdict, prefix = self.seen.get(key, (None, None))
        if verdict is None:  # no earlier verdict for this key: capture only if launches bound this generation's step
            verdict = branch.first_sight
            if verdict is None:
                return _MEASURE
            return True if verdict == "launch_bound" else None
        same_prompt = prefix is not None and _prefix_id(branch) == prefix
        if verdict == "gpu_bound" and not same_prompt:  # its release keeps this verdict (it reaches none itself)
            self._note(GPU_BOUND_AGAIN_REASON)
            return None
        return True

    def _step_before_verdict(self, branch: Branch, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """An eager step, timed: the host's share of its wall time decides whether this generation captures. A key's
        first step is only run (its one-time costs read as host time); while the background warm-up runs, the share
        is this thread's CPU time, and a step below the share leaves the verdict to the next one."""
        if not branch.stepped:
            branch.stepped = True
            return self.transformer.decode(branch, x, t)
        busy = self.background_busy is not None and self.background_busy()
        if busy and not THREAD_CLOCK_FINE:
            return self.transformer.decode(branch, x, t)  # no verdict while the warm-up runs
        cuda = x.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(x.device)
        started, started_cpu = time.perf_counter(), time.thread_time()
        out = self.transformer.decode(branch, x, t)
        host = (time.thread_time() - started_cpu) if busy else (time.perf_counter() - started)
        if cuda:
            torch.cuda.synchronize(x.device)
        total = time.perf_counter() - started
        share = round(min(host / total, 1.0) if total > 0 else 1.0, 3)
        launch_bound = share >= self.launch_bound_share
        if busy and not launch_bound:
            self.deferred_shares.append(share)
            log.debug("decode graphs: host CPU share %.3f while the kernel warm-up runs: no verdict yet", share)
            return out
        branch.first_sight = "launch_bound" if launch_bound else "gpu_bound"
        branch.host_share = share
        log.debug("decode graphs: a new key's timed step, host share %.3f (%s)", share, branch.first_sight)
        if not launch_bound:
            self._note(GPU_BOUND_REASON)
        self.host_shares.append(share)  # reported by describe(): what the choice was made on
        return out

    def _evict_idle(self, keep: int):
        """Drop least recently used idle entries until at most `keep` remain."""
        for key in list(self.entries):
            if len(self.entries) <= keep:
                break
            entry = self.entries[key]
            if entry.in_use:
                continue
            del self.entries[key]
            if isinstance(entry, _Entry):
                entry.branch.release()
                entry.graph = entry.static_out = entry.static_x = entry.static_t = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _capture_new(self, key, branch: Branch) -> _Entry | None:
        self._evict_idle(keep=self.max_entries - 1)  # free before allocating the replacement
        if len(self.entries) >= self.max_entries:
            self._note(f"all {self.max_entries} graph slots are in use")
            return None
        entry = _Entry(key=key, branch=branch, in_use=True)
        try:
            with torch.inference_mode(False), torch.no_grad():
                cfg = self.transformer.config
                n = branch.layout.target_len
                entry.static_x = torch.zeros(branch.batch, n, cfg.in_channels, device=self.transformer.device,
                                             dtype=self.transformer.dtype)  # fmt: skip
                entry.static_t = torch.zeros(branch.batch, device=self.transformer.device, dtype=self.transformer.dtype)
                entry.graph, entry.static_out = self.capture(
                    lambda x, t: self.transformer.decode(branch, x, t, in_graph=True), entry.static_x, entry.static_t
                )
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager, with its reason
            entry.graph = entry.static_out = entry.static_x = entry.static_t = None
            kind = "out of memory" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__
            reason = f"capture failed ({kind}: {str(error).splitlines()[0][:120] if str(error) else ''})"
            self.entries[key] = _Failed(key, reason)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._note(reason)
            return None
        self.entries[key] = entry
        return entry
