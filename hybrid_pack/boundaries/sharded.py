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

__all__ = ["ShardedBoundaries", "LAYOUTS", "layout_chunks", "require_row_count"]

LAYOUTS = ("contiguous", "zigzag")
"""How a row's ``T`` tokens may be distributed over ``R`` ranks: ``"contiguous"``, rank ``r`` holding
``[r*T/R, (r+1)*T/R)``; ``"zigzag"``, the row cut into ``2R`` chunks of ``T/(2R)`` and rank ``r`` holding
chunks ``r`` and ``2R-1-r``, in that order (balances causal attention: an early chunk with a late one)."""

View = TypeVar("View")

Chunk = tuple[int, int]
"""``(row_start, length)``: a run of consecutive row tokens one rank holds."""


def layout_chunks(layout: str, total_tokens: int, world_size: int, rank: int) -> tuple[Chunk, ...]:
    """The row chunks rank ``rank`` holds under ``layout``, in its local order (``total_tokens`` must divide by
    ``world_size``, and by ``2 * world_size`` for ``"zigzag"``)."""
    if layout == "zigzag":
        size = total_tokens // (2 * world_size)
        return (rank * size, size), ((2 * world_size - 1 - rank) * size, size)
    size = total_tokens // world_size
    return ((rank * size, size),)


def _preceding_in_document(starts: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """For each row position, the tokens of its segment before it (``starts``: every segment's start)."""
    return positions - starts[np.searchsorted(starts, positions, side="right") - 1]


@dataclass(frozen=True, eq=False)
class ShardedBoundaries:
    """This rank's part of a packed row split across a context-parallel group.

    Attributes:
        local: :class:`PackedBoundaries` of this rank's ``T_local = row.total_tokens // world_size`` tokens (its
            :attr:`chunks`, in order) cut into segments at document, rank and chunk edges: a document crossing
            an edge is one segment on each side. The row's padding in this rank's last chunk is the last local
            segment (padding in an earlier zigzag chunk is a plain segment there). What a single-device op runs
            on; its ``position_ids`` restart at every local segment.
        row: the boundaries of the whole row (every rank holds the same).
        group: the context-parallel process group (``torch.distributed.ProcessGroup``; None = the world).
        rank, world_size: this rank's index in ``group`` and the group's size.
        offset: the row position of this rank's first token (its first chunk's start: ``rank * T_local``
            contiguous, ``rank * T_local / 2`` zigzag).
        layout: how tokens are distributed over ranks, one of :data:`LAYOUTS`.
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
        _check_split(self.row.total_tokens, self.world_size, self.rank, self.layout)
        per_rank = self.local.total_tokens
        first = self.chunks[0][0]
        if per_rank * self.world_size != self.row.total_tokens or self.offset != first:
            raise BoundaryError(f"local: expected rank {self.rank}'s {self.row.total_tokens // self.world_size} "
                                f"tokens of the {self.row.total_tokens}-token row at offset {first} ({self.layout} "
                                f"layout); got {per_rank} tokens at offset {self.offset} (build them with "
                                "ShardedBoundaries.from_row)")
        edges = np.cumsum([length for _, length in self.chunks])
        if not np.isin(edges, np.cumsum(self.local.segment_lengths)).all():
            raise BoundaryError(f"local: segments {list(self.local.segment_lengths)} are not cut at the edges "
                                f"{edges.tolist()} of this rank's chunks {list(self.chunks)} (build them with "
                                "ShardedBoundaries.from_row)")

    @classmethod
    def from_row(cls, row: PackedBoundaries, *, group: Any, rank: int, world_size: int,
                 layout: str = "contiguous") -> ShardedBoundaries:
        """Rank ``rank``'s part of ``row`` under ``layout`` (:data:`LAYOUTS`; T divisible by R, by 2R for zigzag)."""
        total = row.total_tokens
        _check_split(total, world_size, rank, layout)
        ends = np.cumsum(row.segment_lengths)
        starts = ends - np.asarray(row.segment_lengths)
        pad_row_start = total - row.num_pad_tokens
        chunks = layout_chunks(layout, total, world_size, rank)
        pieces: list[int] = []
        for lo, length in chunks:
            hi = lo + length
            keep = (ends > lo) & (starts < hi)
            pieces += (np.minimum(ends[keep], hi) - np.maximum(starts[keep], lo)).tolist()
        last_lo, last_length = chunks[-1]
        num_pad = max(0, last_lo + last_length - max(last_lo, pad_row_start)) if row.num_pad_tokens else 0
        local = PackedBoundaries.from_lengths(pieces, device=row.device, num_pad_tokens=num_pad)
        return cls(local=local, row=row, group=group, rank=rank, world_size=world_size, offset=chunks[0][0],
                   layout=layout)

    # ------------------------------------------------------------ where the slice sits
    @property
    def device(self) -> torch.device:
        """Where the local tensors are."""
        return self.local.device

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """``(row_start, length)`` of this rank's chunks in local order: one contiguous, two zigzag."""
        return self.chunks_of(self.rank)

    def chunks_of(self, rank: int) -> tuple[Chunk, ...]:
        """The chunks rank ``rank`` of the group holds (what the exchanges are planned from)."""
        return layout_chunks(self.layout, self.row.total_tokens, self.world_size, rank)

    @property
    def chunk_segments(self) -> tuple[tuple[int, ...], ...]:
        """The local segments' lengths, one tuple per chunk (segments are cut at chunk edges)."""
        def build() -> tuple[tuple[int, ...], ...]:
            ends = np.cumsum(self.local.segment_lengths).tolist()
            out, first, edge = [], 0, 0
            for _, length in self.chunks:
                edge += length
                last = ends.index(edge) + 1
                out.append(self.local.segment_lengths[first:last])
                first = last
            return tuple(out)

        return self.view("chunk_segments", build)

    @property
    def chunk_first_positions(self) -> tuple[tuple[int, ...], ...]:
        """For every rank of the group and each of its chunks, the row tokens of the chunk's first segment
        before the chunk's start (0 where a segment starts there): ``[world_size][chunks]``. Host-side, the
        same on every rank."""
        def build() -> tuple[tuple[int, ...], ...]:
            starts = np.asarray(self.row.starts, dtype=np.int64)
            return tuple(tuple(_preceding_in_document(starts, np.asarray([s for s, _ in self.chunks_of(r)])).tolist())
                         for r in range(self.world_size))

        return self.view("chunk_first_positions", build)

    def take(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a whole-row per-token tensor ``[B, T, ...]``: ``[B, T_local, ...]``, its chunks'
        slices along dim 1 in local order."""
        parts = [values[:, start:start + length] for start, length in self.chunks]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @property
    def document_positions(self) -> torch.Tensor:
        """int64 ``[1, T_local]``: positions in the document counted from its start on the row (RoPE's)."""
        def build() -> torch.Tensor:
            positions = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in self.chunks])
            starts = np.asarray(self.row.starts, dtype=np.int64)
            return torch.from_numpy(_preceding_in_document(starts, positions)[None]).to(self.device)

        return self.view("document_positions", build)

    # ------------------------------------------------------------ the contiguous layout's edges
    @property
    def first_segment(self) -> int:
        """Index in ``row`` of this rank's first local segment (contiguous layout)."""
        self._require_contiguous("first_segment")
        return int(np.searchsorted(np.cumsum(self.row.segment_lengths), self.offset, side="right"))

    @property
    def first_positions(self) -> np.ndarray:
        """int64 ``[world_size]``: for every rank of the group, the tokens of its first segment's document held
        by earlier ranks (0 where a segment starts on the rank's edge). Host-side, the same on every rank
        (contiguous layout; :attr:`chunk_first_positions` for any)."""
        self._require_contiguous("first_positions")
        return self.view("first_positions", lambda: np.asarray(
            [positions[0] for positions in self.chunk_first_positions], dtype=np.int64))

    @property
    def first_position(self) -> int:
        """Tokens of the first local segment's document held by earlier ranks, 0 when it starts here (contiguous
        layout)."""
        self._require_contiguous("first_position")
        return int(self.first_positions[self.rank])

    @property
    def continues_from_previous(self) -> bool:
        """Whether the first local segment began on an earlier rank (contiguous layout)."""
        self._require_contiguous("continues_from_previous")
        return self.first_position > 0

    @property
    def continues_into_next(self) -> bool:
        """Whether the last local segment goes on into the next rank (contiguous layout)."""
        self._require_contiguous("continues_into_next")
        return self.rank + 1 < self.world_size and bool(self.first_positions[self.rank + 1])

    def contiguous(self) -> ShardedBoundaries:
        """The contiguous layout's shard of the same row, group and rank (this object when it is one): what
        an op without a path for this layout runs on after :mod:`hybrid_pack.ops.cp.relayout`."""
        if self.layout == "contiguous":
            return self

        def build() -> ShardedBoundaries:
            shard = ShardedBoundaries.from_row(self.row, group=self.group, rank=self.rank,
                                               world_size=self.world_size)
            return shard if shard.device == self.device else shard.to(self.device)

        return self.view("contiguous", build)

    def _require_contiguous(self, name: str) -> None:
        if self.layout != "contiguous":
            raise BoundaryError(
                f"boundaries.{name}: describes a rank holding one contiguous piece of the row, but this shard has "
                f"the {self.layout!r} layout (chunks {list(self.chunks)}); read boundaries.chunks and "
                "boundaries.chunk_first_positions, or run on boundaries.contiguous() after relayouting the tokens "
                "(hybrid_pack.ops.cp.relayout)")

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
    def extended(self, halos: tuple[int, ...]) -> PackedBoundaries:
        """Plain boundaries of ``[halo_0, chunk_0, halo_1, chunk_1, ...]``: ``halos[i]`` preceding row tokens
        joined to chunk ``i``'s first segment (what a single-device op runs on after
        :func:`~hybrid_pack.ops.cp.exchange.with_preceding_tokens`)."""
        if not any(halos):
            return self.local

        def build() -> PackedBoundaries:
            lengths: list[int] = []
            for halo, segments in zip(halos, self.chunk_segments, strict=True):
                lengths += [segments[0] + halo, *segments[1:]]
            return PackedBoundaries.from_lengths(lengths, device=self.device,
                                                 num_pad_tokens=lengths[-1] if self.local.num_pad_tokens else 0)

        return self.view(("extended", tuple(halos)), build)

    # ------------------------------------------------------------ the object itself
    def view(self, key: Hashable, build: Callable[[], View]) -> View:
        """What is derived from the split (exchange plans, state chains, fla's context), built by ``build()`` on
        first use and kept on this object; views of the local segments alone live on ``local``. Built outside
        ``torch.inference_mode``, as :meth:`PackedBoundaries.view`."""
        if key not in self._views:
            with torch.inference_mode(False):
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
        return (f"ShardedBoundaries(rank={self.rank}/{self.world_size}, layout={self.layout!r}, "
                f"chunks={list(self.chunks)}, local={self.local!r}, "
                f"chunk_first_positions={list(self.chunk_first_positions[self.rank])})")


def require_row_count(boundaries: object, num_items_in_batch: object, *, labels_given: bool = False) -> None:
    """Refuse a loss on a context-parallel shard that would divide by the shard's own target count (the shards'
    losses then sum to about R times the row's): InputError naming ``num_items_in_batch`` (``labels_given``:
    unshifted ``labels`` without ``shift_labels``, shifted within the shard, naming ``labels``)."""
    if not isinstance(boundaries, ShardedBoundaries):
        return
    if labels_given:
        raise InputError("labels: a context-parallel shard's last target is the next rank's first label; pass the "
                         "shard's shift_labels and num_items_in_batch from shard_batch")
    if num_items_in_batch is None:
        raise InputError("num_items_in_batch: a context-parallel shard's loss is its share of the row's, divided by "
                         "the whole row's target count; pass the num_items_in_batch shard_batch adds (summed over "
                         "the step's micro-batches)")


def _check_split(total: int, world_size: int, rank: int, layout: str) -> None:
    """Raise :class:`InputError` unless ``rank`` of ``world_size`` can hold a ``layout`` part of ``total`` tokens."""
    if layout not in LAYOUTS:
        raise InputError(f"layout: expected one of {LAYOUTS}; got {layout!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise InputError(f"rank: expected 0 <= rank < world_size ({world_size}); got {rank}")
    parts = 2 * world_size if layout == "zigzag" else world_size
    if total % parts:
        what = (f"the {parts} chunks (2 x the context-parallel size {world_size}) the zigzag layout cuts it into"
                if layout == "zigzag" else f"the context-parallel size {world_size}")
        raise InputError(f"pack_length: the row's {total} tokens do not divide by {what}; pad rows to a multiple "
                         f"of {parts} (PackingCollator(pad_to_multiple_of={parts}) or a pack_length divisible by "
                         f"{parts})")


_PACKED_ONLY = frozenset(
    {f.name for f in fields(PackedBoundaries) if not f.name.startswith("_")}
    | {name for name in dir(PackedBoundaries) if not name.startswith("_")}
) - set(dir(ShardedBoundaries))
"""The :class:`PackedBoundaries` attributes a :class:`ShardedBoundaries` refuses (they exist on ``local``)."""
