"""Differentiable token exchanges between the ranks of a context-parallel group (docs/parallel.md).

Every exchange here has one form: each rank assembles a list of row token ranges, in order, from whichever
ranks hold those tokens (a :class:`TokenExchange`), point to point, with a local copy where it holds them
itself. Its backward sends each received token's gradient back to its owner (and adds the local copies'),
so gradients cross ranks exactly as they cross positions on one device. Who sends what to whom is planned
on the host from the row's boundaries and the layout, which every rank holds, so nothing is negotiated at
run time: a rank that has nothing to send or receive posts nothing.

:func:`with_preceding_tokens`: before each of a rank's chunks, some of the tokens of the chunk's first document
that precede the chunk in the row (the conv its last ``W - 1`` inputs, windowed attention its last ``window - 1``
keys and values). :mod:`hybrid_pack.ops.cp.relayout`: a rank's tokens under another layout. Context-parallel
attention's ring (:mod:`hybrid_pack.ops.attention.ring`) posts one planned exchange per pass with
:func:`post_tokens` / :func:`post_gradients` and overlaps it with the previous pass's compute.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.boundaries.sharded import Chunk, ShardedBoundaries

__all__ = ["TokenExchange", "plan_exchange", "exchange_tokens", "exchange_tokens_together", "PendingExchange",
           "post_tokens", "post_gradients", "HaloPlan", "halo_plan", "with_preceding_tokens"]

Piece = tuple[int, int, int]
"""``(rank, start, stop)``: tokens ``[start, stop)`` of what ``rank`` contributes (its local tokens when it is
the planning rank, else its message to it)."""


@dataclass(frozen=True)
class TokenExchange:
    """This rank's part of one exchange of row tokens.

    Attributes:
        rank: this rank's index in the group.
        sends: ``(peer, start, stop)``: local tokens ``[start, stop)`` go to rank ``peer``; the ranges for one
            peer, joined in this order, are one message.
        receives: ``(peer, count)``: one message of ``count`` tokens from rank ``peer``.
        pieces: the output, in order: ``(rank, start, stop)``, tokens of this rank's local tokens or of the
            message from ``rank``.
    """

    rank: int
    sends: tuple[Piece, ...]
    receives: tuple[tuple[int, int], ...]
    pieces: tuple[Piece, ...]

    def outgoing(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """``(peer, [(start, stop), ...])``: the local ranges of each message sent, by peer."""
        by_peer: dict[int, list[tuple[int, int]]] = {}
        for peer, start, stop in self.sends:
            by_peer.setdefault(peer, []).append((start, stop))
        return list(by_peer.items())


def _append(pieces: list[Piece], piece: Piece) -> None:
    """Append ``piece``, joined to the last one when it continues it."""
    if pieces and pieces[-1][0] == piece[0] and pieces[-1][2] == piece[1]:
        pieces[-1] = (piece[0], pieces[-1][1], piece[2])
    else:
        pieces.append(piece)


def plan_exchange(wanted: Sequence[Sequence[tuple[int, int]]], holdings: Sequence[Sequence[Chunk]],
                  rank: int) -> TokenExchange:
    """Plan rank ``rank``'s part of the exchange where every rank ``q`` assembles the row ranges ``wanted[q]``
    (``(start, stop)``, in order) from the ranks holding them (``holdings[p]``: rank ``p``'s chunks
    ``(row_start, length)`` in its local order). Host-side; every rank plans the same exchange."""
    owners = sorted((start, start + length, p, local)
                    for p, chunks in enumerate(holdings)
                    for (start, length), local in zip(chunks, _local_starts(chunks), strict=True))
    owner_starts = [start for start, *_ in owners]
    sends: list[Piece] = []
    pieces: list[Piece] = []
    received: dict[int, int] = {}
    for receiver, ranges in enumerate(wanted):
        for lo, hi in ranges:
            i = max(bisect.bisect_right(owner_starts, lo) - 1, 0)
            while lo < hi:
                start, stop, owner, local = owners[i]
                end = min(hi, stop)
                begin_local, end_local = local + lo - start, local + end - start
                if receiver == rank and owner == rank:
                    _append(pieces, (rank, begin_local, end_local))
                elif receiver == rank:
                    at = received.get(owner, 0)
                    _append(pieces, (owner, at, at + end - lo))
                    received[owner] = at + end - lo
                elif owner == rank:
                    _append(sends, (receiver, begin_local, end_local))
                lo, i = end, i + 1
    return TokenExchange(rank, tuple(sends), tuple(sorted(received.items())), tuple(pieces))


def _local_starts(chunks: Sequence[Chunk]) -> list[int]:
    starts, at = [], 0
    for _, length in chunks:
        starts.append(at)
        at += length
    return starts


class PendingExchange:
    """One rank's part of a posted exchange (its sends and receives in flight): :meth:`wait` returns the result.

    What a caller overlaps with compute: post the next exchange, compute on the last one's result, then wait."""

    def __init__(self, requests: list[Any], finish: Any) -> None:
        self._requests, self._finish = requests, finish

    def wait(self) -> torch.Tensor:
        """Wait for this rank's sends and receives and return the assembled tensor."""
        for request in self._requests:
            request.wait()
        return self._finish()


def _post(group: Any, outgoing: list[tuple[int, torch.Tensor]], incoming: list[tuple[int, int]],
          like: torch.Tensor) -> tuple[list[Any], list[torch.Tensor]]:
    """Post each send ``(peer, tensor)`` and each receive of ``(peer, count)`` tokens shaped like ``like[0]``:
    ``(requests, receive buffers)``."""
    buffers = [like.new_empty((count, *like.shape[1:])) for _, count in incoming]

    def global_rank(peer: int) -> int:
        return peer if group is None else dist.get_global_rank(group, peer)

    ops = [dist.P2POp(dist.isend, tensor.contiguous(), global_rank(peer), group) for peer, tensor in outgoing]
    ops += [dist.P2POp(dist.irecv, buffer, global_rank(peer), group)
            for (peer, _), buffer in zip(incoming, buffers, strict=True)]
    return (dist.batch_isend_irecv(ops) if ops else []), buffers


def _joined(tokens: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([tokens[start:stop] for start, stop in ranges])


def _exchange(group: Any, outgoing: list[tuple[int, torch.Tensor]], incoming: list[tuple[int, int]],
              like: torch.Tensor) -> list[torch.Tensor]:
    """Send each ``(peer, tensor)``, receive ``(peer, count)`` tokens shaped like ``like[0]``; wait for all."""
    requests, buffers = _post(group, outgoing, incoming, like)
    for request in requests:
        request.wait()
    return buffers


def post_tokens(tokens: torch.Tensor, plan: TokenExchange, group: Any) -> PendingExchange:
    """Post ``plan``'s exchange of ``tokens`` ``[T_local, ...]`` (not differentiable); :meth:`PendingExchange.wait`
    returns the assembled ``[sum of the pieces' lengths, ...]``. A collective over ``group``."""
    outgoing = [(peer, _joined(tokens, ranges)) for peer, ranges in plan.outgoing()]
    requests, buffers = _post(group, outgoing, list(plan.receives), tokens)

    def finish() -> torch.Tensor:
        messages = dict(zip([peer for peer, _ in plan.receives], buffers, strict=True))
        messages[plan.rank] = tokens
        pieces = [messages[source][start:stop] for source, start, stop in plan.pieces]
        return torch.cat(pieces) if pieces else tokens[:0]  # a rank that only sends in this exchange

    return PendingExchange(requests, finish)


def post_gradients(grad: torch.Tensor, plan: TokenExchange, group: Any, into: torch.Tensor) -> PendingExchange:
    """Post the backward of :func:`post_tokens`: ``grad`` ``[sum of the pieces' lengths, ...]`` of the assembled
    tokens goes back to the tokens' owners and is added, in place, into their ``into`` ``[T_local, ...]`` (this
    rank's gradient accumulator, grad's dtype: the local pieces' now, the received ones in
    :meth:`PendingExchange.wait`, which returns ``into``). A collective over ``group``."""
    grads = {peer: grad.new_zeros((count, *grad.shape[1:])) for peer, count in plan.receives}
    grad_tokens = grads[plan.rank] = into
    at = 0
    for source, start, stop in plan.pieces:
        grads[source][start:stop] += grad[at:at + stop - start]
        at += stop - start
    outgoing = plan.outgoing()
    requests, buffers = _post(group, [(peer, grads[peer]) for peer, _ in plan.receives],
                              [(peer, sum(stop - start for start, stop in ranges)) for peer, ranges in outgoing], grad)

    def finish() -> torch.Tensor:
        for (_, ranges), message in zip(outgoing, buffers, strict=True):
            at = 0
            for start, stop in ranges:
                grad_tokens[start:stop] += message[at:at + stop - start]
                at += stop - start
        return grad_tokens

    return PendingExchange(requests, finish)


def _as_bytes(tensors: Sequence[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """``[num_tokens, ...]`` tensors of any dtypes -> one ``uint8 [num_tokens, bytes per token]`` (each token's
    bytes of every tensor side by side): what travels, so tensors of several dtypes go in one message."""
    rows = [t.contiguous().reshape(num_tokens, math.prod(t.shape[1:])).view(torch.uint8) for t in tensors]
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)


def _byte_columns(likes: Sequence[tuple[torch.dtype, torch.Size]]) -> list[tuple[int, int]]:
    """Each tensor's ``[start, stop)`` columns in :func:`_as_bytes`' rows (``likes``: dtype and per-token shape)."""
    columns, at = [], 0
    for dtype, shape in likes:
        width = math.prod(shape) * dtype.itemsize
        columns.append((at, at + width))
        at += width
    return columns


class _ExchangeTokensTogether(torch.autograd.Function):
    """Tensors ``[T_local, ...]`` -> each one's ``[sum of the pieces, ...]``, all in one round of messages (one per
    peer, every tensor's bytes side by side). The backward returns received tokens' gradients to their owners in
    one round too, summed in each tensor's dtype, and adds the local pieces' to the local tokens."""

    @staticmethod
    def forward(ctx: Any, plan: TokenExchange, group: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        num_tokens = tensors[0].shape[0]
        likes = [(t.dtype, t.shape[1:]) for t in tensors]
        ctx.plan, ctx.group, ctx.num_tokens, ctx.likes = plan, group, num_tokens, likes
        local = _as_bytes(tensors, num_tokens)
        outgoing = [(peer, _joined(local, ranges)) for peer, ranges in plan.outgoing()]
        messages = dict(zip([peer for peer, _ in plan.receives],
                            _exchange(group, outgoing, list(plan.receives), local), strict=True))
        messages[plan.rank] = local
        outputs = tuple(
            torch.cat([messages[source][start:stop, lo:hi] for source, start, stop in plan.pieces])
            .view(dtype).view(-1, *shape)
            for (lo, hi), (dtype, shape) in zip(_byte_columns(likes), likes, strict=True))
        ctx.mark_non_differentiable(*(out for out in outputs if not out.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan, num_tokens = ctx.plan, ctx.num_tokens
        floating = [i for i, (dtype, _) in enumerate(ctx.likes) if dtype.is_floating_point]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in floating:
            by_dtype.setdefault(ctx.likes[i][0], []).append(i)
        length = sum(stop - start for _, start, stop in plan.pieces)
        # Per dtype: every floating output's gradient side by side, [length, features], summed per source.
        sums: dict[torch.dtype, dict[int, torch.Tensor]] = {}
        for dtype, members in by_dtype.items():
            width = sum(math.prod(ctx.likes[i][1]) for i in members)
            columns = torch.cat([(grads[i] if grads[i] is not None else
                                  torch.zeros(length, *ctx.likes[i][1], dtype=dtype, device=_device(grads)))
                                 .reshape(length, -1) for i in members], dim=1)
            per_source = {peer: columns.new_zeros(count, width) for peer, count in plan.receives}
            per_source[plan.rank] = columns.new_zeros(num_tokens, width)
            at = 0
            for source, start, stop in plan.pieces:
                per_source[source][start:stop] += columns[at:at + stop - start]
                at += stop - start
            sums[dtype] = per_source
        outgoing = plan.outgoing()
        returned = _exchange(ctx.group, [(peer, _as_bytes([sums[d][peer] for d in by_dtype], count))
                                         for peer, count in plan.receives],
                             [(peer, sum(stop - start for start, stop in ranges)) for peer, ranges in outgoing],
                             _as_bytes([sums[d][plan.rank][:0] for d in by_dtype], 0))
        local = {dtype: per_source[plan.rank] for dtype, per_source in sums.items()}
        for (_, ranges), message in zip(outgoing, returned, strict=True):
            lo = 0
            for dtype, per_source in sums.items():
                width = per_source[plan.rank].shape[1]
                hi = lo + width * dtype.itemsize
                received = message[:, lo:hi].contiguous().view(dtype)
                at = 0
                for start, stop in ranges:
                    local[dtype][start:stop] += received[at:at + stop - start]
                    at += stop - start
                lo = hi
        grads_in: list[torch.Tensor | None] = [None] * len(ctx.likes)
        for dtype, members in by_dtype.items():
            at = 0
            for i in members:
                width = math.prod(ctx.likes[i][1])
                grads_in[i] = local[dtype][:, at:at + width].unflatten(1, ctx.likes[i][1]) \
                    if ctx.likes[i][1] else local[dtype][:, at]
                at += width
        return None, None, *grads_in


def _device(grads: Sequence[torch.Tensor | None]) -> torch.device:
    return next(g.device for g in grads if g is not None)


def exchange_tokens(tokens: torch.Tensor, plan: TokenExchange, group: Any) -> torch.Tensor:
    """The tokens ``plan`` assembles on this rank, from ``tokens`` here and on the other ranks of ``group``.

    A collective over ``group``: every rank calls it with its part of the same planned exchange.

    Args:
        tokens: ``[T_local, ...]`` (any trailing shape and dtype, identical on every rank).
        plan: this rank's :class:`TokenExchange`.

    Returns:
        ``[sum of the pieces' lengths, ...]``; differentiable: each token's gradient flows back to its owner.
    """
    (out,) = exchange_tokens_together([tokens], plan, group)
    return out


def exchange_tokens_together(tensors: Sequence[torch.Tensor], plan: TokenExchange,
                             group: Any) -> tuple[torch.Tensor, ...]:
    """:func:`exchange_tokens` of several tensors in one round: one message per peer carries every tensor's
    tokens (their bytes side by side, whatever their dtypes), and the backward returns the gradients in one round.

    A collective over ``group``: every rank calls it with tensors of the same dtypes and trailing shapes, in the
    same order.

    Args:
        tensors: ``[T_local, ...]`` each (one ``T_local``; any trailing shapes and dtypes).
        plan: this rank's :class:`TokenExchange`.

    Returns:
        Each tensor's ``[sum of the pieces' lengths, ...]``; differentiable (floating tensors): each token's
        gradient flows back to its owner.
    """
    if not tensors:
        return ()
    return _ExchangeTokensTogether.apply(plan, group, *tensors)


@dataclass(frozen=True)
class HaloPlan:
    """This rank's part of the halo exchange: its output is ``[halo_0, chunk_0, halo_1, chunk_1, ...]``.

    Attributes:
        exchange: the :class:`TokenExchange` assembling that output.
        halos: the tokens placed in front of each local chunk.
    """

    exchange: TokenExchange
    halos: tuple[int, ...]

    @property
    def halo_tokens(self) -> int:
        """Tokens placed in front of the chunks, all together."""
        return sum(self.halos)


def halo_plan(boundaries: ShardedBoundaries, limit: int | None) -> HaloPlan:
    """Plan the exchange where every rank receives, before each of its chunks, the last
    ``min(limit, first position)`` row tokens before the chunk (the chunk's first document's earlier tokens).

    ``limit=None`` fetches the whole earlier part of each chunk's first document. Kept on ``boundaries``.
    """

    def build() -> HaloPlan:
        wanted, halos = [], []
        for rank, before in enumerate(boundaries.chunk_first_positions):
            needs = [n if limit is None else min(limit, n) for n in before]
            halos.append(tuple(needs))
            wanted.append([piece for (start, length), need in zip(boundaries.chunks_of(rank), needs, strict=True)
                           for piece in ((start - need, start), (start, start + length))])
        holdings = [boundaries.chunks_of(rank) for rank in range(boundaries.world_size)]
        return HaloPlan(plan_exchange(wanted, holdings, boundaries.rank), halos[boundaries.rank])

    return boundaries.view(("halo_plan", limit), build)


def with_preceding_tokens(tokens: torch.Tensor, boundaries: ShardedBoundaries,
                          limit: int | None = None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's chunks, each with the preceding tokens of its first document in front, fetched from the
    ranks holding them (a local copy where this rank does).

    A collective over ``boundaries.group``: every rank of the group calls it with the same ``limit``.

    Args:
        tokens: ``[T_local, ...]`` (any trailing shape and dtype, identical on every rank).
        boundaries: this rank's :class:`ShardedBoundaries` (any layout).
        limit: fetch at most this many tokens before each chunk (the conv's ``W - 1``); None: all of them.

    Returns:
        ``([halo_0 + chunk_0 + halo_1 + chunk_1 ..., ...], halos)``: ``halos[i]`` row tokens preceding chunk
        ``i``, then the chunk, for every local chunk in order (:attr:`ShardedBoundaries.chunks`).
        Differentiable: the halos' gradients flow back to the tokens they were copied from.
    """
    plan = halo_plan(boundaries, limit)
    return exchange_tokens(tokens, plan.exchange, boundaries.group), plan.halos
