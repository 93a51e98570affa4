"""The Mamba-1 selective scan on one rank's slice of a row split across a context-parallel group (docs/api.md §10).

Over one segment the state goes through ``h_out = exp(sum_t dt_t A) ⊙ h_in + h0``: the map is an elementwise
decay ``[D, N]``, one per channel and state entry (the SSD's is one per head). An incoming state adds, at token
``t`` of the first segment, ``(exp(s_t A) ⊙ h_in) C_t`` to the scan's output (``s_t`` the inclusive cumulative
``dt`` from the segment's start): that is the scan of the first segment from ``h_in`` with no input. The ``D``
skip and the ``silu(z)`` gate come after and are local. So each rank scans its segments from zero
(:func:`.torch_backend.scan`, which also gives the last segment's final state), all-gathers ``(h0 of its last
segment, the decay of its first)``, folds what precedes it (:mod:`hybrid_pack.ops.cp.state_passing`) and scans
its first segment once more from the incoming state; both scans are chunked, so memory stays ``O(T_local·D)``.
Exchanged per rank: ``world_size * 2 * D * N`` numbers, whatever the row length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.ops.cp.state_passing import fold, gather_summaries, state_chain, tie
from hybrid_pack.ops.selective_scan import torch_backend
from hybrid_pack.ops.validate import without_autocast

__all__ = ["selective_scan_cp"]


@without_autocast
def selective_scan_cp(op: Callable[..., torch.Tensor], x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                      B: torch.Tensor, C: torch.Tensor, boundaries: ShardedBoundaries, *, D: torch.Tensor | None,
                      z: torch.Tensor | None, dt_bias: torch.Tensor | None, backend: str | None) -> torch.Tensor:
    """This rank's part of :func:`hybrid_pack.ops.selective_scan` on the whole row.

    Args:
        op: the public single-device op, called with this rank's plain boundaries and ``backend`` when no state
            crosses a rank edge; otherwise the pure-torch scan runs (the one that returns the last segment's
            final state).
        x, dt, z: ``[1, T_local, D]``; A ``[D, N]``; B, C ``[1, T_local, N]``; the rest as the op.
        boundaries: this rank's :class:`ShardedBoundaries`, contiguous layout, its process group checked.

    Returns:
        ``y [1, T_local, D]``: this rank's rows of the whole row's result (float64 inputs: equal to 1e-10,
        outputs and gradients).
    """
    local = boundaries.local
    chain = state_chain(boundaries)
    if not chain.exchanges:
        return op(x, dt, A, B, C, local, D=D, z=z, dt_bias=dt_bias, backend=backend)

    tokens, step, a, b, c = torch_backend.scan_inputs(x, dt, A, B, C, dt_bias)
    y, last_state = torch_backend.scan(tokens, step, a, b, c, local)
    first = local.segment_lengths[0]
    if boundaries.continues_from_previous:
        transition = torch.exp(step[:first].sum(0).unsqueeze(-1) * a)                      # [D, N]
    else:
        transition = torch.zeros_like(last_state)
    channels, state_dim = a.shape
    summaries = gather_summaries(torch.cat([last_state.flatten(), transition.flatten()]), boundaries)

    def unpack(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        final, decay = row.view(2, channels, state_dim).unbind()
        return final, decay

    incoming = fold(chain, summaries, unpack, torch.mul)                                   # [D, N] or None
    if incoming is not None:
        first_segment = PackedBoundaries.from_lengths([first], device=tokens.device)
        correction, _ = torch_backend.scan(torch.zeros_like(tokens[:first]), step[:first], a, b[:first], c[:first],
                                           first_segment, initial_state=incoming)
        y = torch.cat([y[:first] + correction, y[first:]])
    y = tie(y, summaries)
    return torch_backend.skip_and_gate(y, tokens, D, z).unsqueeze(0).to(x.dtype)
