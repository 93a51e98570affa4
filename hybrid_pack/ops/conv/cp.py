"""Causal conv on one rank's slice of a row split across a context-parallel group (docs/parallel.md).

Where one of this rank's chunks starts inside a document, the chunk's first ``W - 1`` outputs read the
document's inputs before the chunk, held by another rank (or by this one, for the zigzag layout's later
chunk). The rank receives, before each chunk, those ``min(W - 1, first position)`` tokens (its halo,
:func:`~hybrid_pack.ops.cp.exchange.with_preceding_tokens`), runs the single-device op once on
``[halo_0, chunk_0, halo_1, chunk_1]`` with each halo joined to its chunk's first segment, and drops the
halos' outputs. The halos' gradients go back to the tokens they came from. Serves every layout. Elements
received per rank: at most ``(W - 1) * D`` per chunk, whatever the row length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.ops.cp.exchange import with_preceding_tokens

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
        x: ``[1, T_local, D]``, this rank's tokens (its chunks in order, any layout).
        weight, bias: as in :func:`hybrid_pack.ops.causal_conv1d` (``weight`` ``[D, W]``).
        boundaries: this rank's :class:`ShardedBoundaries` (a collective over its group).

    Returns:
        ``[1, T_local, D]``.
    """
    boundaries.check_group()
    extended, halos = with_preceding_tokens(x[0], boundaries, limit=weight.shape[1] - 1)
    out = op(extended.unsqueeze(0), weight, bias, boundaries.extended(halos), activation=activation, backend=backend)
    if not any(halos):
        return out
    kept, at = [], 0
    for halo, (_, length) in zip(halos, boundaries.chunks, strict=True):
        kept.append(out[:, at + halo:at + halo + length])
        at += halo + length
    return torch.cat(kept, dim=1)
