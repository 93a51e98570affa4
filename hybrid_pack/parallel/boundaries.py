"""One rank's slice of a packed row split across a context-parallel group (docs/api.md §10).

A :class:`ShardedBoundaries` is deliberately not a :class:`PackedBoundaries`: its local segments are pieces
of documents cut at rank edges, and code written for whole documents would treat them as documents without
a word. So the slice is a context object: ``local`` (this rank's tokens as segments, what a single-device
op runs on, asked for explicitly) beside the facts of the split (``row``, ``group``, ``rank``,
``world_size``, ``offset``, ``layout``). Reading a :class:`PackedBoundaries` attribute from it raises
:class:`BoundaryError` naming ``local`` and the unsharded batch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import BoundaryError, InputError

__all__ = ["ShardedBoundaries", "LAYOUTS"]

LAYOUTS = ("contiguous",)
"""How a row's tokens may be distributed over the ranks: ``"contiguous"``, rank ``r`` holding ``[r*T/R, (r+1)*T/R)``."""

View = TypeVar("View")


@dataclass(frozen=True, eq=False)
class ShardedBoundaries:
    """This rank's part of a packed row split across a context-parallel group.

    Attributes:
        local: :class:`PackedBoundaries` of this rank's ``T_local = row.total_tokens // world_size`` tokens cut
            into segments: a document crossing a rank edge is one segment on each rank it touches, and the
            row's padding segment, or this rank's part of it, stays the last local segment. What a
            single-device op runs on; its ``position_ids`` restart at every local segment.
        row: the boundaries of the whole row (every rank holds the same).
        group: the context-parallel process group (``torch.distributed.ProcessGroup``; None = the world).
        rank, world_size: this rank's index in ``group`` and the group's size.
        offset: the row position of this rank's first token (contiguous layout: ``rank * T_local``).
        layout: how tokens are distributed over ranks (``"contiguous"``).
    """

    local: PackedBoundaries
    row: PackedBoundaries
    group: Any
    rank: int
    world_size: int
    offset: int
    layout: str = "contiguous"
    _views: dict[Hashable, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("local", "row"):
            if not isinstance(getattr(self, name), PackedBoundaries):
                raise BoundaryError(f"{name}: expected a PackedBoundaries; got {type(getattr(self, name)).__name__}")
        if self.layout not in LAYOUTS:
            raise InputError(f"layout: expected one of {LAYOUTS}; got {self.layout!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise InputError(f"rank: expected 0 <= rank < world_size ({self.world_size}); got {self.rank}")
        per_rank = self.local.total_tokens
        if per_rank * self.world_size != self.row.total_tokens or self.offset != self.rank * per_rank:
            raise BoundaryError(f"local: expected rank {self.rank}'s {self.row.total_tokens // self.world_size} "
                                f"tokens of the {self.row.total_tokens}-token row at offset "
                                f"{self.rank * (self.row.total_tokens // self.world_size)}; got {per_rank} tokens "
                                f"at offset {self.offset} (build them with ShardedBoundaries.from_row)")

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
        pieces = (np.minimum(ends[keep], hi) - np.maximum(starts[keep], lo)).tolist()
        pad_row_start = total - row.num_pad_tokens
        num_pad = max(0, hi - max(lo, pad_row_start)) if row.num_pad_tokens else 0
        local = PackedBoundaries.from_lengths(pieces, device=row.device, num_pad_tokens=num_pad)
        return cls(local=local, row=row, group=group, rank=rank, world_size=world_size, offset=lo)

    # ------------------------------------------------------------ where the slice sits
    @property
    def device(self) -> torch.device:
        """Where the local tensors are."""
        return self.local.device

    @property
    def first_segment(self) -> int:
        """Index in ``row`` of this rank's first local segment."""
        return int(np.searchsorted(np.cumsum(self.row.segment_lengths), self.offset, side="right"))

    @property
    def first_positions(self) -> np.ndarray:
        """int64 ``[world_size]``: for every rank of the group, the tokens of its first segment's document held
        by earlier ranks (0 where a segment starts on the rank's edge). Host-side, the same on every rank."""
        def build() -> np.ndarray:
            offsets = np.arange(self.world_size, dtype=np.int64) * self.local.total_tokens
            starts = np.asarray(self.row.starts, dtype=np.int64)
            return offsets - starts[np.searchsorted(starts, offsets, side="right") - 1]

        return self.view("first_positions", build)

    @property
    def first_position(self) -> int:
        """Tokens of the first local segment's document held by earlier ranks (0 when it starts here)."""
        return int(self.first_positions[self.rank])

    @property
    def continues_from_previous(self) -> bool:
        """Whether the first local segment began on an earlier rank."""
        return self.first_position > 0

    @property
    def continues_into_next(self) -> bool:
        """Whether the last local segment goes on into the next rank."""
        return self.rank + 1 < self.world_size and bool(self.first_positions[self.rank + 1])

    @property
    def document_positions(self) -> torch.Tensor:
        """int64 ``[1, T_local]``: positions in the document counted from its start on the row (RoPE's)."""
        return self.view("document_positions", lambda: self.local.position_ids + torch.where(
            self.local.seq_idx == 0, self.first_position, 0))

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

    # ------------------------------------------------------------ plain boundaries around an exchange
    def extended(self, halo: int) -> PackedBoundaries:
        """Plain boundaries of ``halo`` preceding row tokens followed by the local ones, the halo joined to the
        first local segment (what a single-device op runs on after
        :func:`~hybrid_pack.parallel.exchange.with_preceding_tokens`)."""
        if not halo:
            return self.local

        def build() -> PackedBoundaries:
            local = self.local
            lengths = list(local.segment_lengths)
            lengths[0] += halo
            padding_only = local.num_segments == 1 and local.num_pad_tokens > 0
            return PackedBoundaries.from_lengths(lengths, device=local.device,
                                                 num_pad_tokens=lengths[0] if padding_only else local.num_pad_tokens)

        return self.view(("extended", halo), build)

    def after_first(self) -> PackedBoundaries | None:
        """Plain boundaries of the local segments after the first one (None when there is only one)."""
        local = self.local
        if local.num_segments == 1:
            return None
        return self.view("after_first", lambda: PackedBoundaries.from_lengths(
            local.segment_lengths[1:], device=local.device, num_pad_tokens=local.num_pad_tokens))

    # ------------------------------------------------------------ the object itself
    def view(self, key: Hashable, build: Callable[[], View]) -> View:
        """What is derived from the split (exchange plans, state chains, fla's context), built by ``build()`` on
        first use and kept on this object; views of the local segments alone live on ``local``."""
        if key not in self._views:
            self._views[key] = build()
        return self._views[key]

    def to(self, device: torch.device | str) -> ShardedBoundaries:
        """A copy with the local tensors on ``device``; ``row`` stays where it is (only its host-side lengths
        are read, so the whole row's per-token tensors are not copied to every rank's device)."""
        return ShardedBoundaries(local=self.local.to(device), row=self.row, group=self.group, rank=self.rank,
                                 world_size=self.world_size, offset=self.offset, layout=self.layout)

    def __getattr__(self, name: str) -> Any:
        """Only reached for names this class lacks: a :class:`PackedBoundaries` one raises, naming ``local``."""
        if name in _PACKED_ONLY:
            raise BoundaryError(
                f"boundaries: a ShardedBoundaries is one rank's slice of a context-parallel row, not a "
                f"PackedBoundaries, so it has no {name!r} (its local segments are pieces of documents cut at rank "
                f"edges). Code that runs on this rank's tokens as segments reads boundaries.local.{name}; code that "
                "needs whole documents has no context-parallel path: run it on the unsharded batch")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return (f"ShardedBoundaries(rank={self.rank}/{self.world_size}, offset={self.offset}, "
                f"local={self.local!r}, continues_from_previous={self.continues_from_previous}, "
                f"continues_into_next={self.continues_into_next})")


_PACKED_ONLY = frozenset(
    {f.name for f in fields(PackedBoundaries)} | {name for name in dir(PackedBoundaries) if not name.startswith("_")}
) - set(dir(ShardedBoundaries)) - {"_views"}
"""The :class:`PackedBoundaries` attributes a :class:`ShardedBoundaries` refuses (they exist on ``local``)."""
