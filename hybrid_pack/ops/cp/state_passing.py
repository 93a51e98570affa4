"""Recurrent state across rank edges: each rank's summary, one all-gather, and the fold (docs/api.md §10).

A recurrent op (Gated DeltaNet, the SSD) run on a contiguous slice of a packed row needs, for the
document its first local segment continues, the state that document had reached at the rank edge.
Rather than pass it rank after rank, every rank summarises its *last* local segment by

* ``S0``: that segment's final state when started from zero, and
* ``M``: the linear map an incoming state goes through over that segment (used only when the
  segment is the rank's only one and continues from the previous rank: the rank holds only the
  middle of a document),

so that the state leaving rank ``j`` is ``M_j S_in(j) + S0_j``. One all-gather of the summaries
(``world_size`` times a state and a map: independent of the row length) lets every rank fold what
precedes it::

    S_in(r) = S0_{j0};  S_in(r) <- M_j S_in(r) + S0_j  for j = j0+1 .. r-1

where ``j0`` is the last rank before ``r`` whose last segment starts there (the ranks after it, up
to ``r - 1``, hold only the document's middle). Which ranks feed which is read from the row's
boundaries on the host, the same on every rank: no flags are exchanged.

The all-gather is differentiable (its backward all-reduces the summaries' gradient and keeps this
rank's row: an all-reduce runs on every backend, gloo included), so gradients reach the earlier
ranks' inputs. Its backward is itself a collective: every rank's output is tied to the
gathered summaries (:func:`tie`), so every rank's backward runs it, in the same order, and none waits
forever.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries

__all__ = ["StateChain", "state_chain", "segments_as_documents", "segment_initial_states",
           "gather_summaries", "fold", "tie"]


@dataclass(frozen=True)
class StateChain:
    """Where one rank's incoming state comes from, read from the row's boundaries.

    Attributes:
        exchanges: whether any document of the row crosses a rank edge (if not, no rank exchanges).
        sources: the ranks, in row order, whose summaries fold into this rank's incoming state
            (empty when this rank's first segment starts here). The first contributes its ``S0``; each
            later one, holding only the document's middle, applies its ``M`` then adds its ``S0``.
    """

    exchanges: bool
    sources: tuple[int, ...]


def _ranks_passing_through(boundaries: ShardedBoundaries) -> np.ndarray:
    """bool ``[world_size]``: the ranks holding only the middle of one document (their only segment began on
    an earlier rank), through which an incoming state passes on by their map."""
    per_rank, continues = boundaries.local.total_tokens, boundaries.first_positions > 0
    starts = np.asarray(boundaries.row.starts, dtype=np.int64)
    offsets = np.arange(boundaries.world_size, dtype=np.int64) * per_rank
    starts_inside = np.searchsorted(starts, offsets + per_rank) - np.searchsorted(starts, offsets, side="right")
    return continues & (starts_inside == 0)


def state_chain(boundaries: ShardedBoundaries) -> StateChain:
    """This rank's :class:`StateChain` (host-side, cached on ``boundaries``)."""
    def build() -> StateChain:
        passes, rank = _ranks_passing_through(boundaries), boundaries.rank
        sources: list[int] = []
        if boundaries.continues_from_previous:
            j = rank - 1
            while passes[j]:
                j -= 1
            sources = list(range(j, rank))
        return StateChain(exchanges=bool(boundaries.first_positions.any()), sources=tuple(sources))

    return boundaries.view("state_chain", build)


def segments_as_documents(boundaries: ShardedBoundaries) -> PackedBoundaries:
    """The local segments with the padding segment counted as a document, so that it, too, can start
    from a carried state (the row's padding may continue across a rank edge like any segment)."""
    local = boundaries.local
    return boundaries.view("segments_as_documents", lambda: PackedBoundaries(
        cu_seqlens=local.cu_seqlens, seq_idx=local.seq_idx, position_ids=local.position_ids,
        max_seqlen=local.max_seqlen, segment_lengths=local.segment_lengths, num_pad_tokens=0))


def segment_initial_states(initial_states: torch.Tensor | None, boundaries: ShardedBoundaries,
                           dtype: torch.dtype, *, padding: bool = True) -> torch.Tensor | None:
    """The local segments' starting states from the local documents' ``[N_local, ...]``: the user's for
    documents starting here, zero for a document continuing from the previous rank (its initial state
    belongs to the rank where it starts) and, with ``padding``, a zero row for the padding segment
    (``[S, ...]`` for :func:`segments_as_documents`). None stays None."""
    if initial_states is None:
        return None
    states = initial_states.to(dtype)
    if padding:
        padding_rows = boundaries.local.num_segments - boundaries.local.num_docs
        states = torch.cat([states, states.new_zeros(padding_rows, *states.shape[1:])])
    if boundaries.continues_from_previous and states.shape[0]:
        states = torch.cat([states.new_zeros(1, *states.shape[1:]), states[1:]])
    return states


class _AllGather(torch.autograd.Function):
    """``[n]`` on every rank -> ``[world_size, n]``; backward: the group's summed gradient of this rank's row."""

    @staticmethod
    def forward(ctx, summary: torch.Tensor, group: Any, rank: int, world_size: int) -> torch.Tensor:
        ctx.group, ctx.rank = group, rank
        gathered = summary.new_empty(world_size, summary.numel())
        dist.all_gather(list(gathered.unbind()), summary.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


def gather_summaries(summary: torch.Tensor, boundaries: ShardedBoundaries) -> torch.Tensor:
    """Every rank's ``summary`` (a flat tensor of the same size on each), stacked ``[world_size, n]``;
    differentiable: the gradient of rank ``j``'s row goes back to rank ``j``."""
    return _AllGather.apply(summary, boundaries.group, boundaries.rank, boundaries.world_size)


def fold(chain: StateChain, summaries: torch.Tensor,
         unpack: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
         apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """This rank's incoming state, or None when its first segment starts here.

    Args:
        chain: this rank's :class:`StateChain`.
        summaries: ``[world_size, n]`` from :func:`gather_summaries`.
        unpack: a summary row -> ``(S0, M)``.
        apply: ``(M, S) -> M S`` (the op's map applied to a state).
    """
    if not chain.sources:
        return None
    state, _ = unpack(summaries[chain.sources[0]])
    for j in chain.sources[1:]:
        final, transition = unpack(summaries[j])
        state = apply(transition, state) + final
    return state


class _Tie(torch.autograd.Function):
    """``output`` unchanged; ``summaries`` get a zero gradient, so the backward reaches their all-gather."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
        ctx.summaries_like = (summaries.shape, summaries.dtype, summaries.device)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape, dtype, device = ctx.summaries_like
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def tie(output: torch.Tensor, summaries: torch.Tensor) -> torch.Tensor:
    """``output`` unchanged, but depending on ``summaries`` (with a zero gradient), so the backward of the
    all-gather, a collective, runs on every rank even where nothing continues from the previous rank."""
    return _Tie.apply(output, summaries)
