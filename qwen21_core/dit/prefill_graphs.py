"""CUDA graphs of a text prompt's prefill, one per padded prompt length: a changed prompt's prefill without the host's
launches.

A prefill runs every block once over the prompt's rows. At a text-to-image prompt's length (about a hundred tokens)
that is a few milliseconds of GPU work behind tens of milliseconds of Python launching it. The quantised blocks launch
more kernels through more Python than bf16's, so there a 128-token prefill took 1.45-1.77x bf16's (BENCHMARKS
"Kernel launch configurations"). A graph replays the whole prefill in one launch.

Prompts change length, and a graph has fixed shapes. Text attends causally, so a row never sees the rows after it:
the prompt is run padded to its bucket (the next power of two, the same M bucket the kernels are tuned under,
kernels/launch_configs.py `m_bucket`), and the prompt's rows of every layer's K/V are copied into the branch's cache.
Rows past the prompt hold whatever the last replay left there; they are finite and nobody reads them.

Rules:
- only where every block Linear is quantised and carries no LoRA side path: that prefill is the one the host bounds
  most, and there the replayed K/V equal the eager prefill's bit for bit, padded or not (H200, fp8, int8 and
  int8_convrot: bench_cold_start --launch-overhead). bf16 blocks prefill eagerly: their GEMMs at the padded row count
  ran other cuBLAS kernels, and the K/V differed in the last bits, which the exact path may not. A layer kept in bf16
  or a side path's bf16 GEMMs could do the same, so those prefill eagerly too;
- only a text-only prefix (no condition images, no padded keys) of at most MAX_TOKENS tokens, all blocks resident
  (not streaming), one device (no sequence shard), on CUDA; under cudaMallocAsync only where decode graphs may
  capture (dit/decode_graphs.py `async_allocator_blocker`). Anything else prefills eagerly, with the reason in
  `describe()`;
- a bucket's first prefill runs eagerly; its second captures (a capture costs about two eager prefills), and later
  ones replay. At most `max_entries` buckets are kept, the least recently used evicted first;
- a capture needs room: its K/V buffer and the activations of one block at the bucket's length, plus the room the
  decode steps after it need (the planner's decode headroom), in the free memory the planner sees (memory/planner.py).
  A kept graph holds its K/V buffer and pool: about 0.12 GiB more allocated at a 64-row bucket, full size (H200
  sessions, BENCHMARKS "Session"). Without room the prefill runs eagerly and the bucket tries again at its next prompt;
  a failed capture (out of memory, anything) is remembered for the bucket;
- weights that moved and LoRA side paths that changed drop every graph (the signature decode graphs use).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ...kernels.launch_configs import m_bucket
from ..memory.planner import DECODE_HEADROOM_BYTES, HEADROOM_BYTES, device_free_bytes
from ..quant.linear import QuantLinear
from .attention import prefix_masks
from .decode_graphs import async_allocator_blocker, cuda_allocator_backend, warmup_stream, weights_signature
from .sequence import Segment
from .transformer import Branch, QwenImage21Transformer

log = logging.getLogger(__name__)

MAX_TOKENS = 512  # a longer prompt prefills eagerly (its K/V buffer alone would be over 256 MiB at full size)
MIN_BUCKET = 16  # the smallest tensor-core row tile
WARMUP_RUNS = 1  # lazy library set-up and first launches happen here, outside the capture
FIRST_SIGHT_REASON = "the first prompt of its length bucket (captured when the bucket comes again)"


def bucket_for(tokens: int) -> int:
    return max(MIN_BUCKET, m_bucket(tokens))


class _PaddedCache:
    """The cache interface Block.prefill writes through, over one [layers, 2, 1, bucket, H, D] buffer."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv

    def prefill_targets(self, layer: int):
        return self.kv[layer, 0], self.kv[layer, 1]

    def store_prefix(self, layer: int) -> None:
        pass  # the graph's buffer is the storage; the branch's cache gets its rows after the replay


@dataclass
class _PaddedPrefix:
    """What Block.prefill reads of a branch, for a text-only prefix of `bucket` rows (one causal segment)."""

    cache: _PaddedCache
    prefix_cos: torch.Tensor
    prefix_sin: torch.Tensor
    attention_backend: str
    layout: object = None
    prefix_masks: list = field(default_factory=list)
    shard: None = None

    def __post_init__(self):
        rows = self.prefix_cos.shape[0]
        self.layout = _Segments((Segment(0, rows, True),))
        self.prefix_masks = prefix_masks(self.layout.segments, None, self.prefix_cos.device)


@dataclass(frozen=True)
class _Segments:
    segments: tuple


@dataclass
class _Entry:
    bucket: int
    graph: object
    text: torch.Tensor  # [bucket, context_dim]: the prompt's rows first
    cos: torch.Tensor  # [bucket, ...]: the prompt's rotary tables first
    sin: torch.Tensor
    kv: torch.Tensor  # [layers, 2, 1, bucket, H, D]
    replays: int = 0


@dataclass
class _Failed:
    reason: str


class PrefillGraphs:
    def __init__(self, transformer: QwenImage21Transformer, max_entries: int = 2, capture=None):
        self.transformer = transformer
        self.max_entries = max_entries
        self.capture = capture or cuda_graph_capture  # swapped in tests
        self.entries: OrderedDict = OrderedDict()  # key -> _Entry or _Failed
        self.seen: set = set()  # keys prefilled eagerly once
        self.replays = 0  # this generation's replays (describe() reports it)
        self.reasons: list[str] = []
        self._weights: tuple | None = None
        self._blocker: str | None = None  # why these weights prefill eagerly (see _check_weights), or None
        self._logged: set[str] = set()

    # ---- bookkeeping ------------------------------------------------------------------------------

    def _note(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)
        if reason not in self._logged:
            self._logged.add(reason)
            log.info("prefill graphs: %s; prefilling eagerly", reason)

    def describe(self) -> str:
        text = f"replay ({self.replays})" if self.replays else "eager"
        return text + (": " + "; ".join(self.reasons) if self.reasons else "")

    def end_generation(self) -> None:
        self.replays = 0
        self.reasons.clear()

    def clear(self) -> None:
        self.entries.clear()
        self.seen.clear()

    def idle_bytes(self) -> int:
        """Device bytes the kept graphs' K/V buffers hold (their private pools come on top: small, one block's
        activations at the bucket's length)."""
        return sum(e.kv.numel() * e.kv.element_size() for e in self.entries.values() if isinstance(e, _Entry))

    # ---- prefill ----------------------------------------------------------------------------------

    def ineligible(self, branch: Branch, condition_latents) -> str | None:
        """Why this branch's prefill cannot come from a graph, or None."""
        tr, layout = self.transformer, branch.layout
        if self.capture is cuda_graph_capture and tr.device.type != "cuda":
            return "the model is not on CUDA"
        self._check_weights()
        if self._blocker is not None:
            return self._blocker
        if layout.image_rows.numel() or condition_latents is not None or len(layout.segments) != 1:
            return "the prefix has condition images"
        if layout.key_valid is not None:
            return "the prefix has padded keys"
        if layout.prefix_len > MAX_TOKENS:
            return f"the prompt is longer than {MAX_TOKENS} tokens"
        if branch.shard is not None:
            return "sequence parallel"
        if tr.streaming_signature():
            return "blocks stream from host RAM"
        if torch.compiler.is_compiling():
            return "inside torch.compile tracing"
        if self.capture is cuda_graph_capture and cuda_allocator_backend() == "cudaMallocAsync":
            return async_allocator_blocker(False, False)
        return None

    def __call__(self, branch: Branch, prompt_embeds: torch.Tensor, condition_latents=None) -> None:
        """Fill the branch's cache with the prefix K/V: from a graph of its bucket where one serves, else eagerly."""
        tr = self.transformer
        reason = self.ineligible(branch, condition_latents)
        if reason is not None:
            self._note(reason)
            return tr.prefill(branch, prompt_embeds, condition_latents)
        key = (bucket_for(branch.layout.prefix_len), tr.dtype, str(tr.device), branch.attention_backend)
        entry = self.entries.get(key)
        if entry is None and key not in self.seen:
            self.seen.add(key)  # a capture costs about two prefills: only for a bucket that comes back
            self._note(FIRST_SIGHT_REASON)
            return tr.prefill(branch, prompt_embeds, condition_latents)
        if entry is None:
            entry = self._capture_new(key, branch)
        if isinstance(entry, _Failed):
            self._note(entry.reason)
            return tr.prefill(branch, prompt_embeds, condition_latents)
        self.entries.move_to_end(key)
        self._replay(entry, branch, prompt_embeds)

    def _check_weights(self) -> None:
        signature = weights_signature(self.transformer)
        if signature == self._weights:
            return
        if self._weights is not None and self.entries:
            self._note("weights moved since capture: prefill graphs rebuilt")
            self.clear()
        self._weights = signature
        self._blocker = None
        layers = [layer for block in self.transformer.transformer_blocks for layer in block.linears().values()]
        if not all(isinstance(layer, QuantLinear) for layer in layers):
            self._blocker = "bf16 block Linears (the exact path: a padded prefill may round differently there)"
        elif any(layer.side_path is not None for layer in layers):
            self._blocker = "LoRA side paths (bf16 GEMMs: a padded prefill may round differently there)"

    def _inputs(self, entry: _Entry, branch: Branch, prompt_embeds: torch.Tensor) -> None:
        layout, rows = branch.layout, branch.layout.prefix_len
        tr = self.transformer
        entry.text[:rows].copy_(prompt_embeds.to(tr.device, tr.dtype)[layout.text_source.to(tr.device)])
        entry.cos[:rows].copy_(branch.prefix_cos)
        entry.sin[:rows].copy_(branch.prefix_sin)

    def _replay(self, entry: _Entry, branch: Branch, prompt_embeds: torch.Tensor) -> None:
        self._inputs(entry, branch, prompt_embeds)
        entry.graph.replay()
        branch.cache.store_padded_prefix(entry.kv)
        branch.cache.filled = True
        entry.replays += 1
        self.replays += 1

    def _room(self, bucket: int) -> int:
        """Device bytes a capture at `bucket` rows takes: its K/V buffer, inputs and one block's activations."""
        cfg, tr = self.transformer.config, self.transformer
        itemsize = torch.empty((), dtype=tr.dtype).element_size()
        kv = cfg.num_layers * 2 * bucket * cfg.inner_dim * itemsize
        activations = bucket * (4 * cfg.inner_dim + 3 * cfg.mlp_dim + cfg.context_in_dim) * 4  # generous: fp32
        return kv + activations

    def _evict(self, keep: int) -> None:
        while len(self.entries) > keep:
            self.entries.popitem(last=False)

    def _capture_new(self, key: tuple, branch: Branch):
        bucket = key[0]
        self._evict(self.max_entries - 1)
        tr = self.transformer
        need = self._room(bucket)
        if device_free_bytes(tr.device) < need + DECODE_HEADROOM_BYTES + HEADROOM_BYTES:  # (a CPU has room)
            return _Failed(f"no room for a {bucket}-row graph ({need / 2**20:.0f} MiB)")  # not kept: room may come
        cfg = tr.config
        try:
            with torch.inference_mode(False), torch.no_grad():
                text = torch.zeros(bucket, cfg.context_in_dim, device=tr.device, dtype=tr.dtype)
                cos = torch.zeros(bucket, *branch.prefix_cos.shape[1:], device=tr.device, dtype=branch.prefix_cos.dtype)
                sin = torch.zeros_like(cos)
                kv = torch.zeros(cfg.num_layers, 2, 1, bucket, cfg.num_attention_heads, cfg.attention_head_dim,
                                 device=tr.device, dtype=tr.dtype)  # fmt: skip
                padded = _PaddedPrefix(_PaddedCache(kv), cos, sin, branch.attention_backend)
                entry = _Entry(bucket, None, text, cos, sin, kv)
                entry.graph = self.capture(lambda: tr.prefill_blocks(padded, tr.embed_text_prefix(text)))
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager, with its reason
            kind = "out of memory" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__
            failed = _Failed(f"capture failed ({kind}: {str(error).splitlines()[0][:120] if str(error) else ''})")
            self.entries[key] = failed
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return failed
        self.entries[key] = entry
        return entry


def cuda_graph_capture(run) -> torch.cuda.CUDAGraph:
    """Capture `run()` (it writes only into tensors that outlive it) into a CUDA graph, after a warm-up run on a side
    stream."""
    stream = warmup_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread-local: the background kernel warm-up's threads may launch meanwhile (see dit/decode_graphs.py)
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        run()
    return graph
