"""Ulysses sequence parallelism: the token rows split over the ranks, attention split over the heads.

Everything in a block but attention works row by row (the modulated LayerNorms, the QKV, output and MLP
projections), so each rank runs it on its own slice of the rows. Attention needs every row; around it one
all-to-all turns each rank's QKV [its rows, all heads] into [all rows, its heads], attention (with QK-norm and RoPE,
which act per head and per row position) runs for those heads over the whole sequence, and a second all-to-all
turns the output back into [its rows, all heads]. The K/V a rank writes into its cache are therefore its heads
only: the prefix cache is sharded by heads, 1/N of the single-device bytes, and the prefix is computed once, split
over the ranks like every later step.

The transformer calls `to_heads` / `to_tokens` / `rows` / `gather_rows` through the branch's `shard`
(dit/transformer.py) and is otherwise unchanged. Rows and heads that do not divide evenly are split as evenly as
possible (the first ranks take one more).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def even_split(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (index < extra) for index in range(parts)]


def _starts(sizes: list[int]) -> list[int]:
    return [sum(sizes[:index]) for index in range(len(sizes))]


def all_to_all(pieces: list[torch.Tensor], shapes: list[tuple], group=None, packed: torch.Tensor | None = None):
    """Send pieces[j] to rank j and receive one tensor of shapes[j] from each rank j; returns the received data as
    one flat buffer, rank 0's part first (views of it by `shapes` are the pieces). packed: the pieces already laid
    out one after another in one tensor (then they are sent from it without a copy)."""
    send_sizes = [piece.numel() for piece in pieces]
    recv_sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    if packed is not None:
        send = packed.reshape(-1)
    else:
        send = torch.empty(sum(send_sizes), dtype=pieces[0].dtype, device=pieces[0].device)
        for piece, start, size in zip(pieces, _starts(send_sizes), send_sizes, strict=True):
            send[start : start + size].view(piece.shape).copy_(piece)
    recv = torch.empty(sum(recv_sizes), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
    return recv


def _views(flat: torch.Tensor, shapes: list[tuple]) -> list[torch.Tensor]:
    sizes = [int(torch.Size(shape).numel()) for shape in shapes]
    return [flat[start : start + size].view(shape) for start, size, shape in zip(_starts(sizes), sizes, shapes,
                                                                                  strict=True)]  # fmt: skip


class RowSplit:
    """One sequence (a branch's prefix or its target rows) split over the ranks of a process group."""

    def __init__(self, rows: int, heads: int, rank: int, world: int, group=None):
        self.rows_total, self.heads_total = rows, heads
        self.rank, self.world, self.group = rank, world, group
        self.row_sizes = even_split(rows, world)
        self.head_sizes = even_split(heads, world)
        self.row_start = _starts(self.row_sizes)[rank]
        self.head_start = _starts(self.head_sizes)[rank]

    @property
    def local_rows(self) -> int:
        return self.row_sizes[self.rank]

    @property
    def local_heads(self) -> int:
        return self.head_sizes[self.rank]

    def rows(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's rows of a full-length tensor (a view)."""
        return x.narrow(dim, self.row_start, self.local_rows)

    def to_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """QKV [B, rows_r, 3, H, D] of this rank's rows -> [B, rows, 3, heads_r, D]: every row, this rank's heads."""
        b, _, parts, _, d = qkv.shape
        pieces = [qkv[:, :, :, start : start + size] for start, size in zip(_starts(self.head_sizes), self.head_sizes,
                                                                               strict=True)]  # fmt: skip
        shapes = [(b, rows, parts, self.local_heads, d) for rows in self.row_sizes]
        flat = all_to_all(pieces, shapes, self.group)
        if b == 1:  # the pieces come in row order: the buffer already is [1, rows, 3, heads_r, D]
            return flat.view(1, self.rows_total, parts, self.local_heads, d)
        return torch.cat(_views(flat, shapes), dim=1)

    def to_tokens(self, attn: torch.Tensor) -> torch.Tensor:
        """Attention output [B, rows, heads_r, D] -> [B, rows_r, H, D]: this rank's rows, every head."""
        b, _, _, d = attn.shape
        pieces = [attn[:, start : start + size] for start, size in zip(_starts(self.row_sizes), self.row_sizes,
                                                                          strict=True)]  # fmt: skip
        shapes = [(b, self.local_rows, heads, d) for heads in self.head_sizes]
        packed = attn if b == 1 and attn.is_contiguous() else None  # rows in rank order: already one after another
        return torch.cat(_views(all_to_all(pieces, shapes, self.group, packed), shapes), dim=2)

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[B, rows_r, C] from every rank -> [B, rows, C] on every rank."""
        longest = max(self.row_sizes)
        padded = x.new_zeros(x.shape[0], longest, *x.shape[2:])
        padded[:, : x.shape[1]] = x
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:, :rows] for part, rows in zip(parts, self.row_sizes, strict=True)], dim=1)


class SequenceShard:
    """What one rank holds of a sequence-parallel branch: a slice of the prefix rows, a slice of the target rows
    and, for attention and the K/V cache, a slice of the heads."""

    def __init__(self, prefix_len: int, target_len: int, heads: int, rank: int, world: int, group=None):
        self.prefix = RowSplit(prefix_len, heads, rank, world, group)
        self.target = RowSplit(target_len, heads, rank, world, group)
        self.rank, self.world = rank, world

    @property
    def heads(self) -> int:
        """Heads whose attention (and K/V cache) this rank holds."""
        return self.target.local_heads

    def __repr__(self) -> str:
        return (f"SequenceShard(rank {self.rank}/{self.world}: prefix rows {self.prefix.local_rows}/"
                f"{self.prefix.rows_total}, target rows {self.target.local_rows}/{self.target.rows_total}, heads "
                f"{self.heads}/{self.target.heads_total})")  # fmt: skip
