"""One conditioning's denoising run spread over the ranks: the same code on rank 0 (inside the sampler loop) and in
every worker (driven by rank 0's commands), so all ranks issue the same collectives in the same order.

- "cfg": rank j holds CFG branch j (rank 0 the positive prompt, rank 1 the negative one), each with its own whole
  prefix K/V cache and, on CUDA, its own decode graphs. A step broadcasts the latents from rank 0, both ranks decode
  at once, and rank 1's velocity comes back to rank 0, which combines them as the single-process sampler does.
- "sequence": every branch is sharded over all ranks (parallel/ulysses.py): each rank holds a slice of the rows and
  the K/V of a slice of the heads. A step broadcasts the latents, each branch's prefill (step 1) and decode run
  split, and every rank gets the whole velocity back. Steps run eagerly: the all-to-alls between the ranks are not
  captured into CUDA graphs (a graph holding collectives must be captured and replayed in lockstep on every rank,
  and one rank falling back to eager while another replays would hang both).

A rank's sharded caches are kept after a run (`KeptBranches`), so that a rerun of the same conditioning (a new seed)
skips the prefill on every rank, as the decode graphs' kept caches do in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..dit.kv_cache import KVCacheSpec
from ..dit.sequence import build_layout
from ..dit.transformer import Branch, QwenImage21Transformer
from ..options import SampleOptions
from .modes import MODES
from .ulysses import SequenceShard


@dataclass
class BranchInput:
    """What building and prefilling one CFG branch takes (CPU tensors: it travels to the workers)."""

    role: str  # "positive" | "negative"
    embeds: torch.Tensor  # [L, context_dim]
    image_pad_mask: torch.Tensor  # [L] bool
    prefix_id: tuple | None  # what the prefix depends on (sampler.py); None: never reused


@dataclass
class JobSpec:
    """One conditioning's run, as every rank needs it: its branches, the output's latent grid and rows from the
    request, and rank 0's options as rank 0 runs them (K/V placement, graphs and compiled blocks decided there)."""

    mode: str  # one of MODES
    branches: list[BranchInput]
    image_shapes: list[tuple[int, int]]
    cond_tokens: torch.Tensor | None  # [I, in_channels] packed condition latents
    target_shape: tuple[int, int]  # the request's latent grid
    batch: int  # the request's batch_size: rows sharing each prefix
    options: SampleOptions = field(default_factory=SampleOptions)
    loras: tuple = ()  # ((path, identity, strength), ...): what rank 0's weights have merged

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"parallel mode must be one of {MODES}, got {self.mode!r}")

    @property
    def kv(self) -> KVCacheSpec:
        return self.options.kv_spec("gpu")  # rank 0 resolves "auto" before the job travels

    @property
    def attention_backend(self) -> str:
        return self.options.attention_backend

    @property
    def prefix_cache(self) -> bool:
        return self.options.prefix_cache

    @property
    def decode_graphs(self) -> bool:
        return self.options.decode_graphs

    @property
    def compile_blocks(self) -> bool:
        return self.options.compile_blocks


class KeptBranches:
    """Sequence-parallel branches kept after a run for the next one: their caches hold a prefix that a rerun of the
    same conditioning reuses. At most one per role; every rank keeps the same ones."""

    def __init__(self):
        self.entries: dict[str, tuple[tuple, Branch]] = {}  # role -> (what its cache fits, branch)

    def take(self, role: str, transformer: QwenImage21Transformer, layout, spec: JobSpec,
             shard: SequenceShard) -> Branch:  # fmt: skip
        """A branch for this run: the kept cache of this role if it has the shape and format wanted (with fresh
        tables for this layout), else a new branch."""
        fits = self.fits(transformer, layout, spec, shard)
        kept_fits, kept = self.entries.pop(role, (None, None))
        if kept is not None and kept_fits == fits:
            branch = transformer.new_branch_tables(layout, spec.attention_backend)
            branch.cache, branch.shard = kept.cache, shard
            return branch
        if kept is not None:
            kept.release()
        return transformer.new_branch(layout, spec.batch, spec.attention_backend, spec.kv, shard=shard)

    @staticmethod
    def fits(transformer: QwenImage21Transformer, layout, spec: JobSpec, shard: SequenceShard) -> tuple:
        """What a kept cache must match to serve a run: its shape, format and attention backend."""
        return transformer.cache_shape(layout, spec.batch, shard.heads), spec.kv, spec.attention_backend

    def keep(self, role: str, branch: Branch, fits: tuple) -> None:
        old = self.entries.pop(role, (None, None))[1]
        if old is not None:
            old.release()
        self.entries[role] = (fits, branch)

    @property
    def nbytes(self) -> int:
        return sum(branch.cache.nbytes for _, branch in self.entries.values() if branch.cache.allocated)

    def clear(self) -> None:
        for _, branch in self.entries.values():
            branch.release()
        self.entries.clear()


class ParallelJob:
    """One conditioning's run on this rank. Rank 0 passes the latents to `step`; the workers pass None and get them
    by broadcast."""

    def __init__(self, transformer: QwenImage21Transformer, spec: JobSpec, rank: int, world: int, graphs=None,
                 kept: KeptBranches | None = None, group=None):  # fmt: skip
        if spec.mode == "cfg" and (world != 2 or len(spec.branches) != 2):
            raise ValueError(f"CFG parallel runs two branches on two ranks; got {len(spec.branches)} on {world}")
        self.transformer, self.spec, self.rank, self.world, self.group = transformer, spec, rank, world, group
        self.graphs = graphs if spec.decode_graphs and spec.mode == "cfg" else None
        self.kept = kept
        self.held: list[tuple[int, Branch]] = []  # (index in spec.branches, branch) this rank holds
        self.fits: dict[int, tuple] = {}  # sequence parallel: index -> what its cache fits (KeptBranches)
        self.stats = {"prefills": 0, "reused": 0, "cache_bytes": 0, "cache_host_bytes": 0}
        try:
            for index, inputs in enumerate(spec.branches):
                if spec.mode == "cfg" and index != rank:
                    continue
                self.held.append((index, self._branch(index, inputs)))
        except BaseException:
            self.close(keep=False)
            raise
        self.stats["cache_bytes"] = sum(b.cache.nbytes for _, b in self.held)
        self.stats["cache_host_bytes"] = sum(b.cache.host_nbytes for _, b in self.held)

    def _branch(self, index: int, inputs: BranchInput) -> Branch:
        spec, tr = self.spec, self.transformer
        layout = build_layout(inputs.image_pad_mask, spec.image_shapes, spec.target_shape)
        if spec.mode == "cfg":
            if self.graphs is not None:
                return self.graphs.new_branch(layout, spec.batch, spec.attention_backend, inputs.role, spec.kv)
            return tr.new_branch(layout, spec.batch, spec.attention_backend, spec.kv)
        shard = SequenceShard(layout.prefix_len, layout.target_len, tr.config.num_attention_heads, self.rank,
                              self.world, self.group)  # fmt: skip
        self.fits[index] = KeptBranches.fits(tr, layout, spec, shard)
        if self.kept is not None:
            return self.kept.take(inputs.role, tr, layout, spec, shard)
        return tr.new_branch(layout, spec.batch, spec.attention_backend, spec.kv, shard=shard)

    # ---- a step ---------------------------------------------------------------------------------------------

    def step(self, x: torch.Tensor | None, t: torch.Tensor | None, first: bool) -> list[torch.Tensor]:
        """One denoising step; `first`: the prefix is (re)computed now (step 1, or every step without the prefix
        cache). Returns the velocity of every branch on rank 0 (the workers' return value is not used)."""
        x, t = self._broadcast_inputs(x, t)
        if first:
            self._prefill()
        if self.spec.mode == "sequence":
            return [self.transformer.decode(branch, x, t) for _, branch in self.held]
        (_, branch), = self.held  # fmt: skip
        velocity = self._decode(branch, x, t)
        other = velocity if self.rank == 1 else torch.empty_like(velocity)
        dist.broadcast(other, src=1, group=self.group)  # the negative branch's velocity, to rank 0
        return [velocity, other]

    def _broadcast_inputs(self, x, t):
        spec, tr = self.spec, self.transformer
        rows = spec.target_shape[0] * spec.target_shape[1]
        shape = (spec.batch, rows, tr.config.in_channels)
        if self.rank == 0:
            flat = torch.cat([x.reshape(-1).to(tr.dtype), t.reshape(-1).to(tr.dtype)])  # the decode casts to it anyway
        else:
            flat = torch.empty(torch.Size(shape).numel() + spec.batch, dtype=tr.dtype, device=tr.device)
        dist.broadcast(flat, src=0, group=self.group)
        return flat[: -spec.batch].view(shape), flat[-spec.batch :]

    def _decode(self, branch, x, t):
        if self.graphs is not None:
            return self.graphs(branch, x, t)
        return self.transformer.decode(branch, x, t)

    def _prefill(self):
        spec = self.spec
        reusable = [self._reusable(index, branch) for index, branch in self.held]
        if spec.mode == "sequence":
            # every rank must prefill the same branches (the prefill's all-to-alls pair up): reuse only what every
            # rank can reuse (their kept caches mirror each other, so this only guards against surprises)
            agreed = torch.tensor(reusable, dtype=torch.int32)
            if self.transformer.device.type == "cuda":
                agreed = agreed.to(self.transformer.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
            reusable = [bool(flag) for flag in agreed.tolist()]
        for (index, branch), reuse in zip(self.held, reusable, strict=True):
            inputs = spec.branches[index]
            if reuse:
                self.stats["reused"] += 1
                continue
            branch.cache.prefix_id = None
            self.transformer.prefill(branch, inputs.embeds, spec.cond_tokens)
            branch.cache.prefix_id = inputs.prefix_id if spec.prefix_cache else None
            self.stats["prefills"] += 1

    def _reusable(self, index: int, branch: Branch) -> bool:
        prefix_id = self.spec.branches[index].prefix_id
        cache = branch.cache
        return self.spec.prefix_cache and prefix_id is not None and cache.filled and cache.prefix_id == prefix_id

    # ---- the end ----------------------------------------------------------------------------------------------

    def close(self, keep: bool = True) -> dict:
        """Release (or keep, for a rerun) this rank's branches; returns this rank's stats. keep=False after a failure:
        nothing of the run survives."""
        for index, branch in self.held:
            role = self.spec.branches[index].role
            if self.graphs is not None:
                self.graphs.release(branch)
            elif keep and self.kept is not None and branch.shard is not None and branch.cache.filled:
                self.kept.keep(role, branch, self.fits[index])
            else:
                branch.release()
        self.held = []
        if not keep and self.kept is not None:
            self.kept.clear()
        return self.stats
