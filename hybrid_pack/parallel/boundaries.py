"""Boundaries of one rank's slice of a packed row split across a context-parallel group (docs/api.md §10)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError

__all__ = ["ShardedBoundaries"]


@dataclass(frozen=True, eq=False)
class ShardedBoundaries(PackedBoundaries):
    """A :class:`PackedBoundaries` of this rank's tokens that also knows where they sit in the whole row.

    The inherited fields describe the local tokens only: ``T_local = row.total_tokens // world_size``
    tokens cut into local segments (a document crossing a rank edge is one segment on each rank it
    touches; the row's padding segment, or this rank's part of it, stays the last local segment).

    Attributes:
        group: the context-parallel process group (``torch.distributed.ProcessGroup``; None = the world).
        rank, world_size: this rank's index in ``group`` and the group's size.
        offset: the row position of this rank's first token (contiguous layout: ``rank * T_local``).
        row: the boundaries of the whole row (every rank holds the same).
        layout: how tokens are distributed over ranks (``"contiguous"``).
    """

    group: Any = None
    rank: int = 0
    world_size: int = 1
    offset: int = 0
    row: PackedBoundaries | None = None
    layout: str = "contiguous"

    @classmethod
    def from_row(cls, row: PackedBoundaries, *, group: Any, rank: int, world_size: int) -> ShardedBoundaries:
        """Rank ``rank``'s contiguous slice ``[rank*T/R, (rank+1)*T/R)`` of ``row`` (T divisible by R)."""
        total = row.total_tokens
        if world_size < 1 or not 0 <= rank < world_size:
            raise InputError(f"rank: expected 0 <= rank < world_size ({world_size}); got {rank}")
        if total % world_size:
            raise InputError(f"pack_length: the row's {total} tokens do not divide by the context-parallel size "
                             f"{world_size}; pad rows to a multiple of it (PackingCollator(pad_to_multiple_of="
                             f"{world_size}) or a pack_length divisible by {world_size})")
        per_rank = total // world_size
        lo, hi = rank * per_rank, (rank + 1) * per_rank
        ends = np.cumsum(row.segment_lengths)
        starts = ends - np.asarray(row.segment_lengths)
        keep = (ends > lo) & (starts < hi)
        local = (np.minimum(ends[keep], hi) - np.maximum(starts[keep], lo)).tolist()
        pad_row_start = total - row.num_pad_tokens
        num_pad = max(0, hi - max(lo, pad_row_start)) if row.num_pad_tokens else 0
        base = PackedBoundaries.from_lengths(local, device=row.device, num_pad_tokens=num_pad)
        return cls(cu_seqlens=base.cu_seqlens, seq_idx=base.seq_idx, position_ids=base.position_ids,
                   max_seqlen=base.max_seqlen, segment_lengths=base.segment_lengths,
                   num_pad_tokens=base.num_pad_tokens, group=group, rank=rank, world_size=world_size,
                   offset=lo, row=row, layout="contiguous")

    # ------------------------------------------------------------ where the slice sits
    @property
    def first_segment(self) -> int:
        """Index in ``row`` of this rank's first local segment."""
        return int(np.searchsorted(np.cumsum(self.row.segment_lengths), self.offset, side="right"))

    @property
    def first_position(self) -> int:
        """Tokens of the first local segment's document held by earlier ranks (0 when it starts here)."""
        return self.offset - int(self.row.starts[self.first_segment])

    @property
    def continues_from_previous(self) -> bool:
        """Whether the first local segment began on an earlier rank."""
        return self.first_position > 0

    @property
    def continues_into_next(self) -> bool:
        """Whether the last local segment goes on into the next rank."""
        end = self.offset + self.total_tokens
        return end < self.row.total_tokens and end not in set(self.row.starts)

    @property
    def document_positions(self) -> torch.Tensor:
        """int64 ``[1, T_local]``: positions in the document counted from its start on the row (RoPE's)."""
        return self.view("document_positions", lambda: self.position_ids + torch.where(
            self.seq_idx == 0, self.first_position, 0))

    def check_group(self) -> None:
        """Raise :class:`InputError` unless this process is rank ``rank`` of a ``group`` of ``world_size``."""
        if not dist.is_initialized():
            if self.world_size > 1:
                raise InputError(f"boundaries: sharded over {self.world_size} ranks but torch.distributed is not "
                                 "initialised here; call the model under torchrun after init_process_group")
            return
        rank, size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if (rank, size) != (self.rank, self.world_size):
            raise InputError(f"boundaries: built for rank {self.rank} of a group of {self.world_size}, but this "
                             f"process is rank {rank} of a group of {size} in the group they name; build them with "
                             "shard_batch(batch, group) on the process group the model runs on")

    def extended(self, halo: int) -> PackedBoundaries:
        """Plain boundaries of ``halo`` preceding row tokens followed by the local ones, the halo joined to the
        first local segment (what a single-device op runs on after :func:`with_preceding_tokens`)."""
        if not halo:
            return self.local()

        def build() -> PackedBoundaries:
            lengths = list(self.segment_lengths)
            lengths[0] += halo
            padding_only = self.num_segments == 1 and self.num_pad_tokens > 0
            return PackedBoundaries.from_lengths(lengths, device=self.device,
                                                 num_pad_tokens=lengths[0] if padding_only else self.num_pad_tokens)

        return self.view(("extended", halo), build)

    def after_first(self) -> PackedBoundaries | None:
        """Plain boundaries of the local segments after the first one (None when there is only one)."""
        if self.num_segments == 1:
            return None
        return self.view("after_first", lambda: PackedBoundaries.from_lengths(
            self.segment_lengths[1:], device=self.device, num_pad_tokens=self.num_pad_tokens))

    def local(self) -> PackedBoundaries:
        """The local segments as plain boundaries (what a single-device op runs on), kept on this object."""
        return self.view("local", lambda: PackedBoundaries(
            cu_seqlens=self.cu_seqlens, seq_idx=self.seq_idx, position_ids=self.position_ids,
            max_seqlen=self.max_seqlen, segment_lengths=self.segment_lengths, num_pad_tokens=self.num_pad_tokens))

    def to(self, device: torch.device | str) -> ShardedBoundaries:
        """A copy with every tensor on ``device``."""
        base = self.local().to(device)
        return ShardedBoundaries(
            cu_seqlens=base.cu_seqlens, seq_idx=base.seq_idx, position_ids=base.position_ids,
            max_seqlen=base.max_seqlen, segment_lengths=base.segment_lengths, num_pad_tokens=base.num_pad_tokens,
            group=self.group, rank=self.rank, world_size=self.world_size, offset=self.offset,
            row=self.row.to(device), layout=self.layout)

    def __repr__(self) -> str:
        return (f"ShardedBoundaries(rank={self.rank}/{self.world_size}, offset={self.offset}, "
                f"segment_lengths={list(self.segment_lengths[:8])}, num_pad_tokens={self.num_pad_tokens}, "
                f"continues_from_previous={self.continues_from_previous}, "
                f"continues_into_next={self.continues_into_next})")
