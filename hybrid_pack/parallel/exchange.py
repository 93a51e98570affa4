"""Differentiable token exchanges between the ranks of a context-parallel group (docs/parallel.md).

A rank whose first document began on earlier ranks needs some of that document's earlier tokens:
the conv its last ``W - 1`` inputs, attention all its keys and values. :func:`with_preceding_tokens`
fetches exactly those tokens, point to point from the ranks that hold them (a document may span
several ranks), and returns them in front of the local tokens. Its backward sends each received
token's gradient back to its owner, so gradients cross ranks exactly as they cross positions on one
device. Who sends what to whom is planned on the host from the row's boundaries, which every rank
holds, so nothing is negotiated at run time: a rank that has nothing to send or receive posts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybrid_pack.parallel.boundaries import ShardedBoundaries

__all__ = ["HaloPlan", "halo_plan", "with_preceding_tokens"]


@dataclass(frozen=True)
class HaloPlan:
    """This rank's part of one exchange.

    Attributes:
        sends: ``(peer, start, stop)``: local tokens ``[start, stop)`` go to rank ``peer`` of the group.
        receives: ``(peer, count)`` in row order: ``count`` tokens come from rank ``peer``.
    """

    sends: tuple[tuple[int, int, int], ...]
    receives: tuple[tuple[int, int], ...]

    @property
    def halo_tokens(self) -> int:
        """Tokens received: the ones placed in front of the local tokens."""
        return sum(count for _, count in self.receives)


def halo_plan(boundaries: ShardedBoundaries, limit: int | None) -> HaloPlan:
    """Plan the exchange where every rank receives the last ``min(limit, first_position)`` row tokens before it.

    ``limit=None`` fetches the whole earlier part of each rank's first document. Kept on ``boundaries``.
    """

    def build() -> HaloPlan:
        per_rank, me = boundaries.local.total_tokens, boundaries.rank
        needs = boundaries.first_positions
        if limit is not None:
            needs = np.minimum(needs, limit)
        sends, receives = [], []
        for receiver, need in enumerate(needs.tolist()):
            lo, hi = receiver * per_rank - need, receiver * per_rank
            for sender in range(lo // per_rank, receiver) if need else ():
                start, stop = max(lo, sender * per_rank), min(hi, (sender + 1) * per_rank)
                if receiver == me:
                    receives.append((sender, stop - start))
                if sender == me:
                    sends.append((receiver, start - me * per_rank, stop - me * per_rank))
        return HaloPlan(tuple(sends), tuple(receives))

    return boundaries.view(("halo_plan", limit), build)


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


class _WithPrecedingTokens(torch.autograd.Function):
    """``[T_local, ...]`` -> ``[halo + T_local, ...]``; the backward returns the halo's gradient to its owners."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor, plan: HaloPlan, group: Any) -> torch.Tensor:
        ctx.plan, ctx.group = plan, group
        outgoing = [(peer, tokens[start:stop]) for peer, start, stop in plan.sends]
        return torch.cat([*_exchange(group, outgoing, list(plan.receives), tokens), tokens])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        plan = ctx.plan
        halo = plan.halo_tokens
        pieces = grad[:halo].split([count for _, count in plan.receives])
        returned = _exchange(ctx.group, [(peer, piece) for (peer, _), piece in zip(plan.receives, pieces, strict=True)],
                             [(peer, stop - start) for peer, start, stop in plan.sends], grad)
        grad_tokens = grad[halo:].clone()
        for (_, start, stop), piece in zip(plan.sends, returned, strict=True):
            grad_tokens[start:stop] += piece
        return grad_tokens, None, None


def with_preceding_tokens(tokens: torch.Tensor, boundaries: ShardedBoundaries,
                          limit: int | None = None) -> tuple[torch.Tensor, int]:
    """This rank's tokens with the preceding tokens of its first document in front, fetched from earlier ranks.

    A collective over ``boundaries.group``: every rank of the group calls it with the same ``limit``.

    Args:
        tokens: ``[T_local, ...]`` (any trailing shape and dtype, identical on every rank).
        boundaries: this rank's :class:`ShardedBoundaries`.
        limit: fetch at most this many preceding tokens (the conv's ``W - 1``); None: all of them.

    Returns:
        ``([halo + T_local, ...], halo)``: ``halo`` row tokens preceding this rank, then ``tokens``.
        Differentiable: the halo's gradient flows back to the ranks that sent it.
    """
    plan = halo_plan(boundaries, limit)
    return _WithPrecedingTokens.apply(tokens, plan, boundaries.group), plan.halo_tokens
