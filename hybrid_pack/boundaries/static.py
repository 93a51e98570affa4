"""Boundaries known only as tensors: what a compiled graph sees of a packed row (docs/api.md §9).

A :class:`~hybrid_pack.PackedBoundaries` carries host-side Python ints (every segment's length, the
longest one) so eager kernels never synchronise; inside a ``torch.compile`` graph those ints would be
data (a graph break, or a recompile per layout). :class:`StaticBoundaries` holds the same row as its
three tensors (and, optionally, a host copy of ``cu_seqlens``) only, and every Python value it exposes
comes from a shape: ``T`` and the number of segment slots ``S``. With the static batches of
``PackingCollator(pack_length=L, max_documents=M)`` those are ``L`` and ``M + 1`` for every batch, so one
graph serves them all. The ops hand the tensors
to their ``torch.library`` custom ops (:mod:`hybrid_pack.ops.library`), which read the real lengths
outside the graph: from the batch's host copy of ``cu_seqlens`` when it carries one (the collator's
static ``host_boundaries``), so nothing is read from the device (docs/api.md §9b).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.boundaries.host import StaticHostBoundaries
from hybrid_pack.boundaries.packed import PackedBoundaries
from hybrid_pack.errors import BoundaryError, InputError
from hybrid_pack.schema import CU_SEQ_LENS_Q, HOST_BOUNDARIES, POSITION_IDS, SEQ_IDX

__all__ = ["StaticBoundaries"]


class StaticBoundaries:
    """One packed row's boundaries as tensors, with no value read from them.

    Attributes:
        cu_seqlens: int32 ``[S + 1]``: 0 first, non-decreasing, ``T`` last. Segments of length zero may
            follow the last non-empty one (the unused document slots of a static batch), never precede it.
        seq_idx: int32 ``[1, T]``, segment id of each token.
        position_ids: int64 ``[1, T]``, restarting at 0 at every segment.
        host_cu_seqlens: int32 CPU ``[S + 1]``, the values of ``cu_seqlens`` on the host, or None (the ops then
            read ``cu_seqlens``: a device-to-host copy when it is on an accelerator).

    ``total_tokens`` (``T``), ``num_segments`` (``S``) and ``max_seqlen`` (``T``: a bound, not the
    longest segment) come from shapes. Recurrent states (``initial_state`` / final states of the ops)
    are per segment slot: ``[S, ...]``, a zero-length slot's final state being its initial one.
    """

    __slots__ = ("cu_seqlens", "host_cu_seqlens", "position_ids", "seq_idx")

    def __init__(self, cu_seqlens: torch.Tensor, seq_idx: torch.Tensor, position_ids: torch.Tensor,
                 host_cu_seqlens: torch.Tensor | None = None) -> None:
        for name, tensor, dtype, ndim in ((CU_SEQ_LENS_Q, cu_seqlens, torch.int32, 1),
                                          (SEQ_IDX, seq_idx, torch.int32, 2),
                                          (POSITION_IDS, position_ids, torch.int64, 2)):
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tensor.dim() != ndim:
                raise BoundaryError(f"{name}: expected a {dtype} tensor of {ndim} dims (build static batches with "
                                    f"PackingCollator(pack_length=..., max_documents=...)); got "
                                    f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        if seq_idx.shape[0] != 1 or seq_idx.shape != position_ids.shape:
            raise BoundaryError(f"{SEQ_IDX}: expected shape [1, T] like {POSITION_IDS}; got {list(seq_idx.shape)} "
                                f"and {list(position_ids.shape)}")
        if host_cu_seqlens is not None and (host_cu_seqlens.device.type != "cpu"
                                            or host_cu_seqlens.dtype != torch.int32
                                            or host_cu_seqlens.shape != cu_seqlens.shape):
            raise BoundaryError(f"{HOST_BOUNDARIES}.cu_seqlens: expected an int32 CPU tensor of the shape of "
                                f"{CU_SEQ_LENS_Q} {list(cu_seqlens.shape)}; got {host_cu_seqlens.dtype} "
                                f"{list(host_cu_seqlens.shape)} on {host_cu_seqlens.device} (drop it from a batch "
                                "whose boundary keys were edited)")
        self.cu_seqlens = cu_seqlens
        self.seq_idx = seq_idx
        self.position_ids = position_ids
        self.host_cu_seqlens = host_cu_seqlens

    @classmethod
    def from_batch(cls, batch: Mapping[str, Any]) -> StaticBoundaries:
        """From a collator batch's ``cu_seq_lens_q``, ``seq_idx``, ``position_ids`` and static ``host_boundaries``
        (no value is read). 3-D ``position_ids`` (a vision-language model's M-RoPE ids, §3b) are not the documents'
        positions: those are computed from ``cu_seq_lens_q`` and ``seq_idx`` on the device."""
        missing = [key for key in (CU_SEQ_LENS_Q, SEQ_IDX, POSITION_IDS) if batch.get(key) is None]
        if missing:
            raise BoundaryError(f"{missing[0]}: a compiled packed forward needs {CU_SEQ_LENS_Q}, {SEQ_IDX} and "
                                f"{POSITION_IDS} (pass the whole PackingCollator batch)")
        cu_seqlens, seq_idx, position_ids = batch[CU_SEQ_LENS_Q], batch[SEQ_IDX], batch[POSITION_IDS]
        if position_ids.dim() == 3:
            starts = cu_seqlens.to(torch.int64)[seq_idx.to(torch.int64)]
            position_ids = torch.arange(seq_idx.shape[1], device=seq_idx.device)[None] - starts
        host = batch.get(HOST_BOUNDARIES)
        return cls(cu_seqlens, seq_idx, position_ids,
                   host.cu_seqlens if isinstance(host, StaticHostBoundaries) else None)

    @classmethod
    def from_boundaries(cls, boundaries: PackedBoundaries, max_documents: int) -> StaticBoundaries:
        """The static form of ``boundaries``: ``cu_seqlens`` ``[max_documents + 2]``, unused slots repeating ``T``."""
        if boundaries.num_docs > max_documents:
            raise InputError(f"max_documents: the row holds {boundaries.num_docs} documents, more than "
                             f"max_documents={max_documents} (raise max_documents, or plan the packs with "
                             f"plan_packs(..., max_documents={max_documents}))")
        cu_seqlens = boundaries.cu_seqlens.new_full((max_documents + 2,), boundaries.total_tokens)
        cu_seqlens[:boundaries.num_segments + 1] = boundaries.cu_seqlens
        return cls(cu_seqlens, boundaries.seq_idx, boundaries.position_ids)

    @property
    def total_tokens(self) -> int:
        return self.seq_idx.shape[1]

    @property
    def num_segments(self) -> int:
        """Segment slots ``S`` (documents, padding and unused slots alike)."""
        return self.cu_seqlens.shape[0] - 1

    @property
    def document_positions(self) -> torch.Tensor:
        """Each token's position in its document (a static row holds whole documents: ``position_ids``)."""
        return self.position_ids

    @property
    def max_seqlen(self) -> int:
        return self.total_tokens

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def to(self, device: torch.device | str) -> StaticBoundaries:
        return StaticBoundaries(*(t.to(device, non_blocking=True)
                                  for t in (self.cu_seqlens, self.seq_idx, self.position_ids)), self.host_cu_seqlens)

    def __repr__(self) -> str:
        return f"StaticBoundaries(total_tokens={self.total_tokens}, num_segments={self.num_segments})"
