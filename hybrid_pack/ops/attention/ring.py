"""Ring passes: attention of the documents continuing into this rank's chunks over their earlier keys and values,
one peer's part at a time (docs/parallel.md).

A chunk's first segment is a *head* when its document began before the chunk (on an earlier rank, or, zigzag,
in this rank's own earlier chunk). Its queries attend to every earlier key of the document and, causally, to its
own. The earlier keys are cut into *pieces* of an eighth of a chunk (:data:`PIECES_PER_CHUNK`), never across a
chunk edge of the row (every rank's chunks, :func:`layout_chunks`), so each piece is held by one rank. Pass 0 is
each head over its own keys (causal, square); pass ``j >= 1`` brings every rank its ``j``-th piece (one planned
exchange for the whole group, :func:`~hybrid_pack.ops.cp.exchange.plan_exchange`; a rank with no ``j``-th piece
only sends), attends the head's queries to it (every key seen) and merges by log-sum-exp. The next pass's
exchange is posted before this pass's compute and waited for after it, so communication overlaps compute; a rank
holds its own tokens and at most two pieces (an eighth of a chunk each: ``T / 8R`` tokens contiguous,
``T / 16R`` zigzag) of keys and values, never the whole earlier document. Keys and values travel as they are
(two messages per peer, a piece each), never re-stacked; the merge runs in place.

The forward saves only this rank's ``q, k, v``, the heads' output and log-sum-exp; the backward re-passes (as
ring attention does: the pieces are brought again, not kept from the forward): each pass's ``(dq, dk, dv)``
comes from the backend's partial backward against the merged output and log-sum-exp (exact), ``dq`` is added
here, and each piece's ``dk, dv`` (a piece's size) goes back to its owner, which adds it into its own gradient
(the exchange's transpose, posted and waited for one pass later). Every buffer is this rank's size or a piece's:
per-rank memory is ``O(T / R)``. Each pass runs the selected backend's partial form
(:mod:`hybrid_pack.ops.attention.partial`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.ops.attention.partial import PartialAttention
from hybrid_pack.ops.cp.exchange import PendingExchange, TokenExchange, plan_exchange, post_gradients, post_tokens

__all__ = ["PIECES_PER_CHUNK", "RingPlan", "ring_plan", "ring_attention"]

PIECES_PER_CHUNK = 8
"""Each chunk's keys and values travel in this many pieces: the buffers a pass holds (the piece, the next one in
flight, its gradient and the gradient on its way back) are an eighth of a chunk each (4: 7-10 % more per-rank peak
on 4 ranks, benchmarks/bench_cp_attention_memory.py), for more, smaller rounds."""


@dataclass(frozen=True)
class RingPlan:
    """This rank's part of the ring.

    Attributes:
        heads: ``(local_start, length)`` of each head (a local chunk's first segment whose document began
            earlier), in local order.
        passes: one ``(exchange, head)`` per pass after the first, the same number on every rank: the planned
            exchange bringing this rank its piece (keys and values of earlier row tokens, one owner's chunk or
            less) and the index in :attr:`heads` of the head it belongs to (None: this rank only sends).
        piece_tokens: the longest piece this rank receives (0: none).
    """

    heads: tuple[tuple[int, int], ...]
    passes: tuple[tuple[TokenExchange, int | None], ...]
    piece_tokens: int


def _pieces(boundaries: ShardedBoundaries, rank: int) -> list[tuple[int, int, int]]:
    """``(head, start, stop)``: the earlier row tokens of rank ``rank``'s heads cut into pieces of at most
    ``1 / PIECES_PER_CHUNK`` of a chunk, never across a chunk edge of the row, nearest first."""
    chunk = boundaries.row.total_tokens // (boundaries.world_size * (2 if boundaries.layout == "zigzag" else 1))
    unit = -(-chunk // PIECES_PER_CHUNK)
    pieces, head = [], 0
    for (start, _), before in zip(boundaries.chunks_of(rank), boundaries.chunk_first_positions[rank], strict=True):
        if not before:
            continue
        stop = start
        while stop > start - before:   # cut at every piece edge and every chunk edge (one owner per piece)
            lo = max(start - before, (stop - 1) // unit * unit, (stop - 1) // chunk * chunk)
            pieces.append((head, lo, stop))
            stop = lo
        head += 1
    return pieces


def ring_plan(boundaries: ShardedBoundaries) -> RingPlan:
    """Plan this rank's part of the ring from the row (host-side; every rank plans the same passes). Kept on
    ``boundaries``."""

    def build() -> RingPlan:
        every = [_pieces(boundaries, rank) for rank in range(boundaries.world_size)]
        holdings = [boundaries.chunks_of(rank) for rank in range(boundaries.world_size)]
        mine, passes = every[boundaries.rank], []
        for j in range(max(map(len, every))):
            wanted = [[pieces[j][1:]] if j < len(pieces) else [] for pieces in every]
            passes.append((plan_exchange(wanted, holdings, boundaries.rank), mine[j][0] if j < len(mine) else None))
        heads, at = [], 0
        for segments, before in zip(boundaries.chunk_segments, boundaries.chunk_first_positions[boundaries.rank],
                                    strict=True):
            if before:
                heads.append((at, segments[0]))
            at += sum(segments)
        return RingPlan(tuple(heads), tuple(passes), max((hi - lo for _, lo, hi in mine), default=0))

    return boundaries.view("attention_ring_plan", build)


def _merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Two softmax attentions of the same queries over disjoint keys, as one, in place: ``(out, lse)`` (the
    accumulator dtype) becomes the merged attention; ``part_out`` (the caller's to spend) is overwritten."""
    merged = torch.logaddexp(lse, part_lse.to(lse.dtype))
    part_out = part_out.to(out.dtype).mul_(torch.exp(part_lse - merged)[..., None])
    out.mul_(torch.exp(lse - merged)[..., None]).add_(part_out)
    lse.copy_(merged)


def _add_rows(into: torch.Tensor | None, start: int, grad: torch.Tensor, num_tokens: int, dtype: torch.dtype
              ) -> torch.Tensor:
    """``into`` (None: a zero ``[num_tokens, ...]`` accumulator in ``dtype``) with ``grad`` added at rows
    ``[start, start + len(grad))``. A first gradient that covers every row in ``dtype`` becomes the accumulator
    itself (partial backwards return tensors of their own), so a rank's one long head costs no second copy."""
    if into is None:
        if start == 0 and grad.shape[0] == num_tokens and grad.dtype == dtype and grad.is_contiguous():
            return grad
        into = grad.new_zeros((num_tokens, *grad.shape[1:]), dtype=dtype)
    into[start:start + grad.shape[0]] += grad
    return into


def _zeros_if_none(into: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``into``, or a zero accumulator of ``like``'s shape in ``dtype``."""
    return like.new_zeros(like.shape, dtype=dtype) if into is None else into


def _post_piece(k: torch.Tensor, v: torch.Tensor, exchange: TokenExchange, group: Any
                ) -> tuple[PendingExchange, PendingExchange]:
    """Post one pass's exchange of keys and values (two messages per peer, a piece each, never a copy of every
    local token)."""
    return post_tokens(k, exchange, group), post_tokens(v, exchange, group)


class _RingAttention(torch.autograd.Function):
    """``(q, k, v)`` of this rank's tokens -> the heads' outputs ``[sum of head lengths, H, D]`` (a collective),
    then ``q, k, v`` of each range in ``others`` (views).

    Saves only this rank's ``q, k, v``, the heads' output and log-sum-exp: the backward brings the pieces again.
    Beyond those and the gradients, a rank holds at most two pieces of keys and values (the one computed on, the
    next in flight), the gradients of two pieces (the one computed, the last one on its way back) and one head's
    partial output or ``dq``. The gradients of the handed-out ranges are added into the same accumulators."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                partial: PartialAttention, scale: float, group: Any, others: tuple[tuple[int, int], ...]
                ) -> tuple[torch.Tensor, ...]:
        options = {"scale": scale, "window": None}
        accumulator = torch.float64 if q.dtype == torch.float64 else torch.float32
        pending = _post_piece(k, v, plan.passes[0][0], group) if plan.passes else None  # in flight meanwhile
        merged = []
        for s, n in plan.heads:
            out, lse = partial.forward(q[s:s + n], k[s:s + n], v[s:s + n], causal=True, **options)
            merged.append((out.to(accumulator), lse.to(accumulator)))
        for j, (_, head) in enumerate(plan.passes):
            piece_k, piece_v = (exchange.wait() for exchange in pending)
            pending = _post_piece(k, v, plan.passes[j + 1][0], group) if j + 1 < len(plan.passes) else None
            if head is not None:
                start, length = plan.heads[head]
                _merge_into(*merged[head], *partial.forward(q[start:start + length], piece_k, piece_v,
                                                            causal=False, **options))
            del piece_k, piece_v
        if merged:
            out = (merged[0][0] if len(merged) == 1 else torch.cat([o for o, _ in merged])).to(q.dtype)
            lse = merged[0][1] if len(merged) == 1 else torch.cat([lse for _, lse in merged])
        else:
            out, lse = q[:0], q.new_empty(0, q.shape[1], dtype=accumulator)
        del merged
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.partial, ctx.scale, ctx.group, ctx.others = plan, partial, scale, group, others
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, no zero tensor
        return out, *(t[start:stop] for start, stop in others for t in (q, k, v))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, *grad_others: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        plan, partial, group = ctx.plan, ctx.partial, ctx.group
        options = {"scale": ctx.scale, "window": None}
        accumulator = lse.dtype
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        pending = _post_piece(k, v, plan.passes[0][0], group) if plan.passes else None  # in flight meanwhile
        grad_q = grad_k = grad_v = None
        spans, at = [], 0
        for start, length in plan.heads:
            spans.append((start, length, slice(at, at + length)))
            at += length
        for start, length, rows in spans:
            dq, dk, dv = partial.backward(grad_out[rows], q[start:start + length], k[start:start + length],
                                          v[start:start + length], out[rows], lse[rows], causal=True, **options)
            grad_q = _add_rows(grad_q, start, dq, q.shape[0], accumulator)
            grad_k = _add_rows(grad_k, start, dk, k.shape[0], accumulator)
            grad_v = _add_rows(grad_v, start, dv, v.shape[0], accumulator)
            del dq, dk, dv
        # The handed-out ranges' gradients (the caller's ops' results, maybe shared: added, never adopted).
        for i, (start, stop) in enumerate(ctx.others):
            handed = grad_others[3 * i:3 * i + 3]
            if start == stop or all(g is None for g in handed):
                continue
            grad_q, grad_k, grad_v = (
                acc if g is None else _add_rows(_zeros_if_none(acc, t, accumulator), start, g, t.shape[0], accumulator)
                for acc, g, t in zip((grad_q, grad_k, grad_v), handed, (q, k, v), strict=True))
        if grad_k is None and plan.passes:  # a rank without heads: its keys' gradients come back from the others
            grad_k, grad_v = (t.new_zeros(t.shape, dtype=accumulator) for t in (k, v))
        returning: tuple[PendingExchange, PendingExchange] | None = None
        for j, (exchange, head) in enumerate(plan.passes):
            piece_k, piece_v = (exchange_.wait() for exchange_ in pending)
            pending = _post_piece(k, v, plan.passes[j + 1][0], group) if j + 1 < len(plan.passes) else None
            if head is None:
                grad_piece_k = grad_piece_v = piece_k.new_empty(piece_k.shape, dtype=accumulator)  # nothing here
            else:
                start, length, rows = spans[head]
                dq, grad_piece_k, grad_piece_v = partial.backward(
                    grad_out[rows], q[start:start + length], piece_k, piece_v, out[rows], lse[rows], causal=False,
                    **options)
                grad_q = _add_rows(grad_q, start, dq, q.shape[0], accumulator)
                del dq
            del piece_k, piece_v
            if returning is not None:
                for exchange_ in returning:
                    exchange_.wait()
            returning = (post_gradients(grad_piece_k.to(accumulator), exchange, group, grad_k),
                         post_gradients(grad_piece_v.to(accumulator), exchange, group, grad_v))
            del grad_piece_k, grad_piece_v
        if returning is not None:
            for exchange_ in returning:
                exchange_.wait()
        return (*(None if g is None else g.to(t.dtype) for g, t in ((grad_q, q), (grad_k, k), (grad_v, v))),
                None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: ShardedBoundaries, *,
                   partial: PartialAttention, scale: float, others: Sequence[tuple[int, int]] = ()
                   ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """The outputs of this rank's heads (:attr:`RingPlan.heads`, in order), attending to their documents' earlier
    keys on any rank and, causally, to their own. A collective over ``boundaries.group``: every rank calls it
    (a rank without heads still sends its pieces), forward and backward.

    Args:
        q: ``[T_local, H, D]``; k, v: ``[T_local, Hkv, D]``, this rank's tokens (one dtype).
        boundaries: this rank's :class:`ShardedBoundaries` (any layout).
        partial: the selected backend's partial form.
        scale: multiplies ``q @ k^T``.
        others: local token ranges ``(start, stop)`` the caller attends by other means (the segments after each
            chunk's head): handed back as ``(q, k, v)`` views, differentiable through the ring, so that their
            gradients are added into the ring's own (one gradient buffer per tensor, where two consumers of
            ``q, k, v`` would each fill a zero tensor of its whole size). Feed them, not slices of ``q, k, v``,
            to those ops.

    Returns:
        ``(out, handed)``: ``out`` ``[sum of head lengths, H, D]`` in q's dtype, and one ``(q, k, v)`` per range
        of ``others``; differentiable: keys' and values' gradients go back to their owners.
    """
    outputs = _RingAttention.apply(q, k, v, ring_plan(boundaries), partial, float(scale), boundaries.group,
                                   tuple(others))
    handed = outputs[1:]
    return outputs[0], [tuple(handed[3 * i:3 * i + 3]) for i in range(len(others))]
