"""Causal conv on one rank's slice of a row split across a context-parallel group (docs/parallel.md).

Where this rank's first document began on earlier ranks, its first ``W - 1`` outputs read inputs held
there. The rank receives those ``min(W - 1, first_position)`` tokens (the halo,
:func:`~hybrid_pack.parallel.exchange.with_preceding_tokens`), runs the single-device op on
``[halo, local]`` with the halo joined to the first local segment, and drops the halo's outputs. The
halo's gradient goes back to the ranks that sent it. Bytes received per rank: at most
``(W - 1) * D`` elements, whatever the row length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.parallel.boundaries import ShardedBoundaries
from hybrid_pack.parallel.exchange import with_preceding_tokens

LocalConv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, PackedBoundaries], torch.Tensor]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, boundaries: ShardedBoundaries,
                  *, local: LocalConv) -> torch.Tensor:
    """This rank's slice of the conv over the whole row.

    Args:
        x: ``[1, T_local, D]``, this rank's tokens.
        weight, bias: as in :func:`hybrid_pack.ops.causal_conv1d` (``weight`` ``[D, W]``).
        boundaries: this rank's :class:`ShardedBoundaries` (a collective over its group).
        local: the single-device op (the selected backend), called as ``local(x, weight, bias, boundaries)``.

    Returns:
        ``[1, T_local, D]``.
    """
    extended, halo = with_preceding_tokens(x[0], boundaries, limit=weight.shape[1] - 1)
    return local(extended.unsqueeze(0), weight, bias, boundaries.extended(halo))[:, halo:]
