"""The Mamba-1 selective scan on one rank's slice of a row split across a context-parallel group (docs/api.md §10).

Over one segment the state goes through ``h_out = exp(sum_t dt_t A) ⊙ h_in + h0``: the map is an elementwise
decay ``[D, N]``, one per channel and state entry (the SSD's is one per head). An incoming state adds, at token
``t`` of the first segment, ``(exp(s_t) ⊙ h_in) C_t`` to the scan's output (``s_t`` the inclusive cumulative
``dt A`` from the segment's start); the ``D`` skip and the ``silu(z)`` gate come after and are local. So each
rank scans its segments from zero (:mod:`.torch_backend`), all-gathers ``(h0 of its last segment, the decay of
its first)`` and folds what precedes it (:mod:`hybrid_pack.parallel.state_passing`); the correction is a
product per token. Exchanged per rank: ``world_size * 2 * D * N`` numbers, whatever the row length.
"""

from __future__ import annotations

import torch

from hybrid_pack.ops.selective_scan import torch_backend
from hybrid_pack.parallel.boundaries import ShardedBoundaries
from hybrid_pack.parallel.state_passing import fold, gather_summaries, state_chain, tie

__all__ = ["scan"]


def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
         boundaries: ShardedBoundaries) -> torch.Tensor:
    """The state-space part of the selective scan on this rank's tokens, as the scan of the whole row gives it.

    Args:
        x, dt: ``[T_local, D]`` (``dt`` discretised: ``softplus(dt + dt_bias)``).
        A: ``[D, N]``.
        B, C: ``[T_local, N]``.
        boundaries: this rank's :class:`ShardedBoundaries`, contiguous layout (:func:`~.op.selective_scan` moves
            another layout's tokens to it), its process group checked.

    Returns:
        ``y [T_local, D]`` in the inputs' (common) dtype: this rank's rows of the whole row's ``h_t C_t``
        (float64 inputs: equal to 1e-10, outputs and gradients).
    """
    local = boundaries.local
    y = torch_backend.scan(x, dt, A, B, C, local)
    chain = state_chain(boundaries)
    if not chain.exchanges:
        return y

    channels, state_dim = A.shape
    # The last segment's final state from zero: sum_t exp(sum_{u > t} dt_u A) ⊙ (dt_t x_t) B_t^T, the decay
    # summed from each token to the segment's end (a suffix sum: no difference of large cumulative sums).
    last = local.segment_lengths[-1]
    log_decay = dt[-last:].unsqueeze(-1) * A                                              # [last, D, N]
    decay_after = torch.cat([log_decay[1:].flip(0).cumsum(0).flip(0), torch.zeros_like(log_decay[:1])]).exp()
    last_state = torch.einsum("tdn,td,tn->dn", decay_after, dt[-last:] * x[-last:], B[-last:])
    first = local.segment_lengths[0]
    if boundaries.continues_from_previous:
        decay_to = torch.cumsum(dt[:first].unsqueeze(-1) * A, dim=0).exp()              # [first, D, N]
        transition = decay_to[-1]
    else:
        transition = torch.zeros_like(last_state)

    summaries = gather_summaries(torch.cat([last_state.flatten(), transition.flatten()]), boundaries)

    def unpack(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        final, decay = row.view(2, channels, state_dim).unbind()
        return final, decay

    incoming = fold(chain, summaries, unpack, torch.mul)                                   # [D, N] or None
    if incoming is not None:
        correction = torch.einsum("tdn,tn->td", decay_to * incoming, C[:first])
        y = torch.cat([y[:first] + correction, y[first:]])
    return tie(y, summaries)
