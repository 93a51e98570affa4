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

from hybrid_pack.parallel.boundaries import ShardedBoundaries
from hybrid_pack.parallel.exchange import with_preceding_tokens

__all__ = ["causal_conv1d_cp"]


def causal_conv1d_cp(op: Callable[..., torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None, boundaries: ShardedBoundaries, *, activation: str | None,
                     backend: str | None) -> torch.Tensor:
    """This rank's slice of :func:`hybrid_pack.ops.causal_conv1d` over the whole row.

    The pure-torch path: it runs around the single-device op with ``backend`` when no sharded backend
    (flash-linear-attention's own context parallelism, :mod:`.kernel_fla_cp`) serves the call
    (:mod:`hybrid_pack.ops.dispatch.route`).

    Args:
        op: the public single-device op (called with plain boundaries and ``backend``).
        x: ``[1, T_local, D]``, this rank's tokens.
        weight, bias: as in :func:`hybrid_pack.ops.causal_conv1d` (``weight`` ``[D, W]``).
        boundaries: this rank's :class:`ShardedBoundaries` (a collective over its group).

    Returns:
        ``[1, T_local, D]``.
    """
    boundaries.check_group()
    extended, halo = with_preceding_tokens(x[0], boundaries, limit=weight.shape[1] - 1)
    out = op(extended.unsqueeze(0), weight, bias, boundaries.extended(halo), activation=activation, backend=backend)
    return out[:, halo:]
