"""Differentiable token exchanges between the ranks of a context-parallel group (docs/parallel.md).

Every exchange here has one form: each rank assembles a list of row token ranges, in order, from whichever
ranks hold those tokens (a :class:`TokenExchange`), point to point, with a local copy where it holds them
itself. Its backward sends each received token's gradient back to its owner (and adds the local copies'),
so gradients cross ranks exactly as they cross positions on one device. Who sends what to whom is planned
on the host from the row's boundaries and the layout, which every rank holds, so nothing is negotiated at
run time: a rank that has nothing to send or receive posts nothing.

Two exchanges use it. :func:`with_preceding_tokens`: before each of a rank's chunks, some of the tokens of
the chunk's first document that precede the chunk in the row (the conv its last ``W - 1`` inputs,
attention all its keys and values). :mod:`hybrid_pack.ops.cp.relayout`: a rank's tokens under another
layout.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.boundaries.sharded import Chunk, ShardedBoundaries

__all__ = ["TokenExchange", "plan_exchange", "exchange_tokens", "HaloPlan", "halo_plan", "with_preceding_tokens"]

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


def _exchange(group: Any, outgoing: list[tuple[int, torch.Tensor]], incoming: list[tuple[int, int]],
              like: torch.Tensor) -> list[torch.Tensor]:
    """Send each ``(peer, tensor)``, receive ``(peer, count)`` tokens shaped like ``like[0]``; wait for all."""
    buffers = [like.new_empty((count, *like.shape[1:])) for _, count in incoming]

    def global_rank(peer: int) -> int:
        return peer if group is None else dist.get_global_rank(group, peer)

    ops = [dist.P2POp(dist.isend, tensor.contiguous(), global_rank(peer), group) for peer, tensor in outgoing]
    ops += [dist.P2POp(dist.irecv, buffer, global_rank(peer), group)
            for (peer, _), buffer in zip(incoming, buffers, strict=True)]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return buffers


def _joined(tokens: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([tokens[start:stop] for start, stop in ranges])


class _ExchangeTokens(torch.autograd.Function):
    """``[T_local, ...]`` -> ``[sum of the pieces, ...]``; the backward returns received tokens' gradients to
    their owners and adds the local pieces' to the local tokens."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, plan: TokenExchange, group: Any) -> torch.Tensor:
        ctx.plan, ctx.group, ctx.num_tokens = plan, group, tokens.shape[0]
        outgoing = [(peer, _joined(tokens, ranges)) for peer, ranges in plan.outgoing()]
        messages = dict(zip([peer for peer, _ in plan.receives],
                            _exchange(group, outgoing, list(plan.receives), tokens), strict=True))
        messages[plan.rank] = tokens
        return torch.cat([messages[source][start:stop] for source, start, stop in plan.pieces])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        plan = ctx.plan
        grads = {peer: grad.new_zeros((count, *grad.shape[1:])) for peer, count in plan.receives}
        grad_tokens = grads[plan.rank] = grad.new_zeros((ctx.num_tokens, *grad.shape[1:]))
        at = 0
        for source, start, stop in plan.pieces:
            grads[source][start:stop] += grad[at:at + stop - start]
            at += stop - start
        outgoing = plan.outgoing()
        returned = _exchange(ctx.group, [(peer, grads[peer]) for peer, _ in plan.receives],
                             [(peer, sum(stop - start for start, stop in ranges)) for peer, ranges in outgoing], grad)
        for (_, ranges), message in zip(outgoing, returned, strict=True):
            at = 0
            for start, stop in ranges:
                grad_tokens[start:stop] += message[at:at + stop - start]
                at += stop - start
        return grad_tokens, None, None


def exchange_tokens(tokens: torch.Tensor, plan: TokenExchange, group: Any) -> torch.Tensor:
    """The tokens ``plan`` assembles on this rank, from ``tokens`` here and on the other ranks of ``group``.

    A collective over ``group``: every rank calls it with its part of the same planned exchange.

    Args:
        tokens: ``[T_local, ...]`` (any trailing shape and dtype, identical on every rank).
        plan: this rank's :class:`TokenExchange`.

    Returns:
        ``[sum of the pieces' lengths, ...]``; differentiable: each token's gradient flows back to its owner.
    """
    return _ExchangeTokens.apply(tokens, plan, group)


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
