"""CUDA graphs of a text prompt's prefill, one per padded prompt length: a changed prompt's prefill without the host's
launches.

A prefill runs every block once over the prompt's rows. At a text-to-image prompt's length (about a hundred tokens)
that is little GPU work behind much longer Python launching it. The quantised blocks launch more kernels through more
Python than bf16's, so there a short prefill took longer than bf16's although its GEMMs are faster. A graph replays
the blocks in one launch.

Prompts change length, and a graph has fixed shapes. Text attends causally, so a row never sees the rows after it:
the blocks run on the prompt padded to its bucket (the next power of two, the M bucket the kernels are tuned under,
kernels/launch_configs.py `m_bucket`), and the prompt's rows of every layer's K/V are copied into the branch's cache.
The text projection (`txt_in`, bf16) runs eagerly on the prompt's own rows, as in the eager prefill. Rows past the
prompt hold whatever the last replay left there; they are finite and nobody reads them.

Rules:
- only where every block Linear runs a W8A8 GEMM (fp8 `_scaled_mm`, our int8 kernel, `_int_mm`) at both the prompt's
  and the bucket's row count, with no LoRA side path: that prefill is the one the host bounds most, its row
  quantiser and integer GEMMs compute a row from that row alone, and there the replayed K/V equalled the eager
  prefill's bit for bit (fp8, int8 and int8_convrot at full size, bench_cold_start --launch-overhead; prompts of
  several lengths on the tiny model, tests/test_prefill_graphs.py). bf16 GEMMs (bf16 blocks, layers
  kept in bf16, the weight-only path, side paths) ran other cuBLAS kernels at the padded row count and the K/V
  differed in the last bits, which the exact path may not: those prefill eagerly. So do attention backends other
  than "auto" and "flash";
- only a text-only prefix (no condition images, no padded keys) of at most MAX_TOKENS tokens, all blocks resident
  (not streaming: the graphs are dropped then), one device (no sequence shard), on CUDA; under cudaMallocAsync only
  where decode graphs may capture (dit/decode_graphs.py `async_allocator_blocker`). Anything else prefills eagerly,
  with the reason in `describe()`;
- a bucket's first prefill runs eagerly; its second captures (a capture costs more than an eager prefill, so only a
  bucket that comes back pays it), and later ones replay. At most `max_entries` buckets are kept, the least recently
  used dropped first;
- a capture needs room: its buffers and one block's activations at the bucket's length, plus the room the decode steps
  after it need (the planner's decode headroom), in what the planner sees free under the pipeline's budget
  (memory/planner.py). A kept graph holds its K/V buffer and pool, whose idle bytes the planner counts as taken
  (`graph_pool_idle_bytes`). Without room the prefill runs eagerly and the bucket tries again at its next prompt; a
  failed capture (out of memory, anything) is not retried;
- weights that moved and LoRA side paths that changed drop every graph (the signature decode graphs use).
"""

from __future__ import annotations

import logging
import types
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ...kernels.launch_configs import m_bucket
from ..memory.planner import DECODE_HEADROOM_BYTES, HEADROOM_BYTES, device_free_bytes
from ..quant.linear import INT_MM_MIN_ROWS, QuantLinear
from .attention import prefix_masks
from .decode_graphs import (
    async_allocator_blocker,
    capture_graph,
    cuda_allocator_backend,
    run_before_capture,
    weights_signature,
)
from .sequence import Segment
from .transformer import Branch, QwenImage21Transformer

log = logging.getLogger(__name__)

MAX_TOKENS = 512  # a longer prompt prefills eagerly (its K/V buffer alone would be over 256 MiB at full size)
ROW_EXACT_GEMMS = ("scaled_mm", "triton_int8", "int_mm")  # quant/linear.py backends that compute a row from itself
ATTENTION_BACKENDS = ("auto", "flash")  # the prefill's attention choices the identity was measured with
FIRST_SIGHT_REASON = "the first prompt of its length bucket (captured when the bucket comes again)"


def bucket_for(tokens: int) -> int:
    """The padded length a prompt of `tokens` tokens prefills at: its kernels' M bucket."""
    return m_bucket(tokens)


class _PaddedCache:
    """The cache interface Block.prefill writes through, over one [layers, 2, 1, bucket, H, D] buffer."""

    def __init__(self, kv: torch.Tensor):
        self.kv = kv

    def prefill_targets(self, layer: int):
        return self.kv[layer, 0], self.kv[layer, 1]

    def store_prefix(self, layer: int) -> None:
        pass  # the graph's buffer is the storage; the branch's cache gets its rows after the replay


class _PaddedPrefix:
    """What Block.prefill reads of a branch (cache, rotary tables, segments, masks), for a text-only prefix of the
    bucket's rows: one causal text run."""

    shard = None

    def __init__(self, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention_backend: str):
        self.cache = _PaddedCache(kv)
        self.prefix_cos, self.prefix_sin = cos, sin
        self.attention_backend = attention_backend
        self.layout = types.SimpleNamespace(segments=(Segment(0, cos.shape[0], True),))
        self.prefix_masks = prefix_masks(self.layout.segments, None, cos.device)


@dataclass
class _Entry:
    graph: object
    x: torch.Tensor  # [1, bucket, D]: the prompt's rows after txt_in first
    cos: torch.Tensor  # [bucket, ...]: the prompt's rotary tables first
    sin: torch.Tensor
    kv: torch.Tensor  # [layers, 2, 1, bucket, H, D]


class PrefillGraphs:
    def __init__(self, transformer: QwenImage21Transformer, max_entries: int = 2, capture=None):
        self.transformer = transformer
        self.max_entries = max_entries
        self.capture = capture or cuda_graph_capture  # swapped in tests
        self.budget: int | None = None  # the pipeline's device budget (bytes; None: what the device has)
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.failed: dict[tuple, str] = {}  # keys whose capture failed -> why (not retried)
        self.seen: set = set()  # keys prefilled eagerly once
        self.replays = 0  # this generation's replays (describe() reports it)
        self.reasons: list[str] = []
        self._weights: tuple | None = None
        self._gemm_blockers: dict[bool, str | None] = {}  # by "at least INT_MM rows": why the GEMMs are not row-exact
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
        self.failed.clear()
        self.seen.clear()

    # ---- prefill ----------------------------------------------------------------------------------

    def ineligible(self, branch: Branch, condition_latents) -> str | None:
        """Why this branch's prefill cannot come from a graph, or None."""
        tr, layout = self.transformer, branch.layout
        if self.capture is cuda_graph_capture and tr.device.type != "cuda":
            return "the model is not on CUDA"
        if tr.streaming_signature():
            if self.entries:
                self.clear()  # their memory is better spent on resident blocks
            return "blocks stream from host RAM"
        if layout.image_rows.numel() or condition_latents is not None:
            return "the prefix has condition images"
        if len(layout.segments) != 1 or not layout.segments[0].is_text or layout.key_valid is not None:
            return "the prefix is not one unpadded text run"
        if layout.prefix_len > MAX_TOKENS:
            return f"the prompt is longer than {MAX_TOKENS} tokens"
        if branch.shard is not None:
            return "sequence parallel"
        if branch.attention_backend not in ATTENTION_BACKENDS:
            return f"attention backend {branch.attention_backend!r} (graphs are checked with {ATTENTION_BACKENDS})"
        if torch.compiler.is_compiling():
            return "inside torch.compile tracing"
        if self.capture is cuda_graph_capture and cuda_allocator_backend() == "cudaMallocAsync":
            blocker = async_allocator_blocker(False, False)
            if blocker is not None:
                return blocker
        self._check_weights()
        for rows in (layout.prefix_len, bucket_for(layout.prefix_len)):
            blocker = self._gemm_blocker(rows)
            if blocker is not None:
                return blocker
        return None

    def __call__(self, branch: Branch, prompt_embeds: torch.Tensor, condition_latents=None) -> None:
        """Fill the branch's cache with the prefix K/V: from a graph of its bucket where one serves, else eagerly."""
        tr = self.transformer
        reason = self.ineligible(branch, condition_latents)
        if reason is not None:
            self._note(reason)
            return tr.prefill(branch, prompt_embeds, condition_latents)
        key = (bucket_for(branch.layout.prefix_len), tr.dtype, str(tr.device), branch.attention_backend)
        if key in self.failed:
            self._note(self.failed[key])
            return tr.prefill(branch, prompt_embeds, condition_latents)
        entry = self.entries.get(key)
        if entry is None and key not in self.seen:
            self.seen.add(key)  # a capture costs more than a prefill: only for a bucket that comes back
            self._note(FIRST_SIGHT_REASON)
            return tr.prefill(branch, prompt_embeds, condition_latents)
        if entry is None:
            entry = self._capture_new(key, branch)
            if isinstance(entry, str):
                self._note(entry)
                return tr.prefill(branch, prompt_embeds, condition_latents)
        self.entries.move_to_end(key)
        self._replay(entry, branch, prompt_embeds)

    def _check_weights(self) -> None:
        signature = weights_signature(self.transformer)
        if signature == self._weights:
            return
        if self._weights is not None and (self.entries or self.failed):
            self._note("weights moved since capture: prefill graphs rebuilt")
            self.clear()
        self._weights = signature
        self._gemm_blockers.clear()

    def _gemm_blocker(self, rows: int) -> str | None:
        """Why a block Linear would not run a row-exact W8A8 GEMM at `rows` rows, or None (cached per weights and the
        one row threshold backends have, quant/linear.py INT_MM_MIN_ROWS)."""
        many = rows >= INT_MM_MIN_ROWS
        if many not in self._gemm_blockers:
            self._gemm_blockers[many] = None
            for block in self.transformer.transformer_blocks:
                for layer in block.linears().values():
                    if not isinstance(layer, QuantLinear) or not layer.quantize_activations:
                        reason = "bf16 GEMMs in the blocks (a padded prefill may round differently there)"
                    elif layer.side_path is not None:
                        reason = "LoRA side paths (bf16 GEMMs: a padded prefill may round differently there)"
                    elif (backend := layer.backend(rows)) not in ROW_EXACT_GEMMS:
                        reason = f"the {backend} path in the blocks (a padded prefill may round differently there)"
                    else:
                        continue
                    self._gemm_blockers[many] = reason
                    return reason
        return self._gemm_blockers[many]

    def _inputs(self, entry: _Entry, branch: Branch, prompt_embeds: torch.Tensor) -> None:
        """The prompt's rows into the graph's inputs: txt_in eagerly on them (bf16 GEMMs at their own row count)."""
        layout, rows = branch.layout, branch.layout.prefix_len
        tr = self.transformer
        text = prompt_embeds.to(tr.device, tr.dtype)[layout.text_source.to(tr.device)]
        entry.x[0, :rows].copy_(tr.txt_in(text))
        entry.cos[:rows].copy_(branch.prefix_cos)
        entry.sin[:rows].copy_(branch.prefix_sin)

    def _replay(self, entry: _Entry, branch: Branch, prompt_embeds: torch.Tensor) -> None:
        self._inputs(entry, branch, prompt_embeds)
        entry.graph.replay()
        branch.cache.store_padded_prefix(entry.kv)
        branch.cache.filled = True
        self.replays += 1

    def _room(self, bucket: int) -> int:
        """Device bytes a capture at `bucket` rows takes: its K/V buffer, inputs and one block's activations."""
        cfg, tr = self.transformer.config, self.transformer
        itemsize = torch.empty((), dtype=tr.dtype).element_size()
        kv = cfg.num_layers * 2 * bucket * cfg.inner_dim * itemsize
        activations = bucket * (5 * cfg.inner_dim + 3 * cfg.mlp_dim) * 4  # generous: fp32
        return kv + activations

    def _capture_new(self, key: tuple, branch: Branch) -> _Entry | str:
        """A captured entry for `key`, or why there is none (a failure is remembered; no room is not)."""
        bucket = key[0]
        while len(self.entries) >= self.max_entries:
            self.entries.popitem(last=False)
        tr, cfg = self.transformer, self.transformer.config
        need = self._room(bucket)
        if device_free_bytes(tr.device, self.budget) < need + DECODE_HEADROOM_BYTES + HEADROOM_BYTES:  # CPU: room
            return f"no room for a {bucket}-row graph ({need / 2**20:.0f} MiB)"
        try:
            with torch.inference_mode(False), torch.no_grad():
                x = torch.zeros(1, bucket, cfg.inner_dim, device=tr.device, dtype=tr.dtype)
                cos = torch.zeros(bucket, *branch.prefix_cos.shape[1:], device=tr.device, dtype=branch.prefix_cos.dtype)
                sin = torch.zeros_like(cos)
                kv = torch.zeros(cfg.num_layers, 2, 1, bucket, cfg.num_attention_heads, cfg.attention_head_dim,
                                 device=tr.device, dtype=tr.dtype)  # fmt: skip
                padded = _PaddedPrefix(kv, cos, sin, branch.attention_backend)
                graph = self.capture(lambda: tr.prefill_blocks(padded, x))
        except Exception as error:  # noqa: BLE001 - any capture failure falls back to eager, with its reason
            kind = "out of memory" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__
            self.failed[key] = f"capture failed ({kind}: {str(error).splitlines()[0][:120] if str(error) else ''})"
        else:
            self.entries[key] = _Entry(graph, x, cos, sin, kv)
            return self.entries[key]
        # after the except block: its traceback (and the buffers the frames hold) is gone, so the memory comes back
        x = cos = sin = kv = padded = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return self.failed[key]


def cuda_graph_capture(run) -> torch.cuda.CUDAGraph:
    """Capture `run()` (it writes only into tensors that outlive it) into a CUDA graph, after its runs before the
    capture on a side stream (dit/decode_graphs.py)."""
    run_before_capture(run)
    return capture_graph(run)
