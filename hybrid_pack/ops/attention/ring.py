"""Ring passes: attention of the documents continuing into this rank's chunks over their earlier keys and values,
one peer's part at a time (docs/parallel.md).

A chunk's first segment is a *head* when its document began before the chunk (on an earlier rank, or, zigzag,
in this rank's own earlier chunk). Its queries attend to every earlier key of the document and, causally, to its
own. The earlier keys are cut into *pieces* of a quarter of a chunk (:data:`PIECES_PER_CHUNK`), never across a
chunk edge of the row (every rank's chunks, :func:`layout_chunks`), so each piece is held by one rank. Pass 0 is
each head over its own keys (causal, square); pass ``j >= 1`` brings every rank its ``j``-th piece (one planned
exchange for the whole group, :func:`~hybrid_pack.ops.cp.exchange.plan_exchange`; a rank with no ``j``-th piece
only sends), attends the head's queries to it (every key seen) and merges by log-sum-exp. The next pass's
exchange is posted before this pass's compute and waited for after it, so communication overlaps compute; a rank
holds its own tokens and at most two pieces (a quarter chunk each: ``T / 4R`` tokens contiguous, ``T / 8R``
zigzag) of keys and values, never the whole earlier document.

The backward re-passes: the same exchanges bring the pieces again, each pass's ``(dq, dk, dv)`` comes from the
backend's partial backward against the merged output and log-sum-exp (exact), ``dq`` stays here, and each
piece's ``dk, dv`` goes back to its owner (the exchange's transpose, posted and waited for one pass later).
Each pass runs the selected backend's partial form (:mod:`hybrid_pack.ops.attention.partial`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.ops.attention.partial import PartialAttention
from hybrid_pack.ops.cp.exchange import PendingExchange, TokenExchange, plan_exchange, post_gradients, post_tokens

__all__ = ["PIECES_PER_CHUNK", "RingPlan", "ring_plan", "ring_attention"]

PIECES_PER_CHUNK = 4
"""Each chunk's keys and values travel in this many pieces: the buffers a pass holds (the piece, the next one in
flight, its gradient and the gradient on its way back) are a quarter of a chunk each, for more, smaller rounds."""


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


def _merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax attentions of the same queries over disjoint keys, as one: ``(out, lse)`` in lse's dtype."""
    merged = torch.logaddexp(lse, part_lse.to(lse.dtype))
    out = out * torch.exp(lse - merged)[..., None] + part_out.to(lse.dtype) * torch.exp(part_lse - merged)[..., None]
    return out, merged


class _RingAttention(torch.autograd.Function):
    """``(q, k, v)`` of this rank's tokens -> the heads' outputs ``[sum of head lengths, H, D]`` (a collective)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan,
                partial: PartialAttention, scale: float, group: Any) -> torch.Tensor:
        options = {"scale": scale, "window": None}
        heads = [partial.forward(q[s:s + n], k[s:s + n], v[s:s + n], causal=True, **options) for s, n in plan.heads]
        accumulator = torch.float64 if q.dtype == torch.float64 else torch.float32
        merged = [(out.to(accumulator), lse.to(accumulator)) for out, lse in heads]
        keys_values = torch.stack([k, v], dim=1)
        pending = post_tokens(keys_values, plan.passes[0][0], group) if plan.passes else None
        for j, (_, head) in enumerate(plan.passes):
            piece = pending.wait()
            pending = post_tokens(keys_values, plan.passes[j + 1][0], group) if j + 1 < len(plan.passes) else None
            if head is not None:
                start, length = plan.heads[head]
                part = partial.forward(q[start:start + length], piece[:, 0], piece[:, 1], causal=False, **options)
                merged[head] = _merge(*merged[head], *part)
        out = torch.cat([o.to(q.dtype) for o, _ in merged]) if merged else q[:0]
        lse = torch.cat([lse for _, lse in merged]) if merged else q.new_empty(0, q.shape[1], dtype=accumulator)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.partial, ctx.scale, ctx.group = plan, partial, scale, group
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        plan, partial, group = ctx.plan, ctx.partial, ctx.group
        options = {"scale": ctx.scale, "window": None}
        accumulator = lse.dtype
        grad_q = torch.zeros(q.shape, dtype=accumulator, device=q.device)
        grad_keys_values = torch.zeros((k.shape[0], 2, *k.shape[1:]), dtype=accumulator, device=k.device)
        spans, at = [], 0
        for start, length in plan.heads:
            spans.append((start, length, slice(at, at + length)))
            at += length
        for start, length, rows in spans:
            dq, dk, dv = partial.backward(grad_out[rows], q[start:start + length], k[start:start + length],
                                          v[start:start + length], out[rows], lse[rows], causal=True, **options)
            grad_q[start:start + length] += dq
            grad_keys_values[start:start + length, 0] += dk
            grad_keys_values[start:start + length, 1] += dv
        keys_values = torch.stack([k, v], dim=1)
        pending = post_tokens(keys_values, plan.passes[0][0], group) if plan.passes else None
        returning: PendingExchange | None = None
        for j, (exchange, head) in enumerate(plan.passes):
            piece = pending.wait()
            pending = post_tokens(keys_values, plan.passes[j + 1][0], group) if j + 1 < len(plan.passes) else None
            grad_piece = piece.new_zeros(piece.shape, dtype=accumulator)
            if head is not None:
                start, length, rows = spans[head]
                dq, dk, dv = partial.backward(grad_out[rows], q[start:start + length], piece[:, 0], piece[:, 1],
                                              out[rows], lse[rows], causal=False, **options)
                grad_q[start:start + length] += dq
                grad_piece[:, 0], grad_piece[:, 1] = dk, dv
            if returning is not None:
                grad_keys_values += returning.wait()
            returning = post_gradients(grad_piece, exchange, group, k.shape[0])
        if returning is not None:
            grad_keys_values += returning.wait()
        return (grad_q.to(q.dtype), grad_keys_values[:, 0].to(k.dtype), grad_keys_values[:, 1].to(v.dtype),
                None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: ShardedBoundaries, *,
                   partial: PartialAttention, scale: float) -> torch.Tensor:
    """The outputs of this rank's heads (:attr:`RingPlan.heads`, in order), attending to their documents' earlier
    keys on any rank and, causally, to their own. A collective over ``boundaries.group``: every rank calls it
    (a rank without heads still sends its pieces), forward and backward.

    Args:
        q: ``[T_local, H, D]``; k, v: ``[T_local, Hkv, D]``, this rank's tokens (one dtype).
        boundaries: this rank's :class:`ShardedBoundaries` (any layout).
        partial: the selected backend's partial form.
        scale: multiplies ``q @ k^T``.

    Returns:
        ``[sum of head lengths, H, D]`` in q's dtype; differentiable: keys' and values' gradients go back to their
        owners.
    """
    return _RingAttention.apply(q, k, v, ring_plan(boundaries), partial, float(scale), boundaries.group)
