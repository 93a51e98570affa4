"""The Mamba-2 SSD scan on one rank's slice of a row split across a context-parallel group (docs/api.md §10).

Over one segment the state goes through ``h_out = exp(sum_t dt_t A) h_in + h0``: the map is one decay
per head. An incoming state adds, at token ``t`` of the first segment, ``exp(s_t) h_in C_t`` to the
scan's output (``s_t`` the cumulative ``dt A`` from the segment's start), before the ``silu(z)`` gate;
``D x`` and the gate are local. So each rank runs the local op from zero (or the user's initial
states), all-gathers ``(h0 of its last segment, the decay of its first)`` and folds what precedes it
(:mod:`hybrid_pack.ops.cp.state_passing`); the correction is a product per token. ``h0`` is computed
in closed form over the last segment, so the local op is asked for no states it was not asked for by
the caller, and any backend (mamba-ssm's kernel included) serves it. Exchanged per
rank: ``world_size * H * (P * N + 1)`` numbers, whatever the row length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.ops.cp.state_passing import (
    fold,
    gather_summaries,
    segment_initial_states,
    state_chain,
    tie,
)
from hybrid_pack.ops.dispatch.discovery import recording_keys
from hybrid_pack.ops.ssd.torch_backend import discretize_dt
from hybrid_pack.ops.validate import state_dtype, without_autocast

__all__ = ["mamba2_ssd_cp"]


@without_autocast
def mamba2_ssd_cp(op: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
                  dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, boundaries: ShardedBoundaries,
                  *, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                  chunk_size: int, initial_states: torch.Tensor | None, return_final_states: bool,
                  backend: str | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of :func:`hybrid_pack.ops.mamba2_ssd` on the whole row.

    Args:
        op: the public single-device op (called with plain boundaries and ``backend``).
        x, z: ``[1, T_local, H, P]``; dt ``[1, T_local, H]``; B, C ``[1, T_local, G, N]``; the rest as the op.
        boundaries: this rank's :class:`ShardedBoundaries`.
        initial_states: ``[N_local, H, P, N]`` for the local documents. A document's initial state belongs
            to the rank where it starts: the entry of a first document continuing from the previous rank
            is not used (its gradient is zero).
        return_final_states: also return ``[N_local, H, P, N]``: each local document's state after its
            last token on this rank (its final state when it ends here, the state handed on otherwise).

    Returns:
        ``y [1, T_local, H, P]``, or ``(y, final states)``, as the op on the whole row restricted to this
        rank (float64 inputs: equal to 1e-10).
    """
    kwargs = {"D": D, "z": z, "dt_bias": dt_bias, "dt_softplus": dt_softplus, "chunk_size": chunk_size,
              "backend": backend}
    boundaries.check_group()
    local = boundaries.local
    if recording_keys() and x.shape[1] and initial_states is not None:
        # the warm-up's discovery pass: the single-device calls of every layout (no state crossing a rank edge: the
        # caller's states; an edge cutting a document: states in float32), met on the first token, as later rows
        # make them whatever this row's edges
        state = initial_states.new_zeros(1, *initial_states.shape[1:])
        for states in (state, state.to(state_dtype(x.dtype))):
            op(*(t[:, :1] for t in (x, dt)), A, *(t[:, :1] for t in (B, C)),
               PackedBoundaries.from_lengths([1], x.device), **{**kwargs, "z": None if z is None else z[:, :1]},
               return_final_states=return_final_states, initial_states=states)
    chain = state_chain(boundaries)
    if not chain.exchanges:
        return op(x, dt, A, B, C, local, **kwargs, initial_states=initial_states,
                  return_final_states=return_final_states)

    heads, head_dim, groups, state_dim = x.shape[2], x.shape[3], B.shape[2], B.shape[3]
    cdtype = state_dtype(x.dtype)
    continues = boundaries.continues_from_previous
    starts = segment_initial_states(initial_states, boundaries, cdtype, padding=False)
    result = op(x, dt, A, B, C, local, **kwargs, initial_states=starts,
                return_final_states=return_final_states)
    y, finals = result if return_final_states else (result, None)
    bias = None if dt_bias is None else dt_bias.to(cdtype)

    def steps_and_log_decay(span: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``dt`` as the op applies it and the inclusive cumulative ``dt A`` over ``span``, ``[L, H]`` each."""
        step = discretize_dt(dt[0, span].to(cdtype), bias, dt_softplus)
        return step, torch.cumsum(step * A.to(cdtype), dim=0)

    # The last segment's final state, in closed form (so the local op need not return states, and any
    # backend serves it): sum_t exp(s_end - s_t) dt_t x_t B_t^T, plus its starting state decayed.
    last = local.segment_lengths[-1]
    step, log_decay = steps_and_log_decay(slice(-last, None))
    b_heads = B[0, -last:].to(cdtype).repeat_interleave(heads // groups, dim=1)         # [last, H, N]
    last_state = torch.einsum("th,thp,thn->hpn", (log_decay[-1] - log_decay).exp() * step,
                              x[0, -last:].to(cdtype), b_heads)
    if starts is not None and local.num_segments == local.num_docs:  # the last segment is a document
        last_state = last_state + log_decay[-1].exp()[:, None, None] * starts[-1]
    first = local.segment_lengths[0]
    if continues:
        _, first_log_decay = steps_and_log_decay(slice(0, first))                      # [first, H]
        transition = first_log_decay[-1].exp()                                          # [H]
    else:
        transition = last_state.new_zeros(heads)

    summaries = gather_summaries(torch.cat([last_state.flatten(), transition]), boundaries)

    def unpack(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return row[:-heads].view(heads, head_dim, state_dim), row[-heads:]

    incoming = fold(chain, summaries, unpack, lambda m, h: m[:, None, None] * h)  # [H, P, N] or None
    if incoming is not None:
        c_heads = C[0, :first].to(cdtype).repeat_interleave(heads // groups, dim=1)  # [first, H, N]
        correction = torch.einsum("hpn,thn->thp", incoming, c_heads) * first_log_decay.exp()[..., None]
        if z is not None:
            correction = correction * F.silu(z[0, :first].to(cdtype))
        y = torch.cat([y[:, :first] + correction.to(y.dtype), y[:, first:]], dim=1)
        if finals is not None and local.num_docs:
            finals = torch.cat([finals[:1] + transition[:, None, None] * incoming, finals[1:]])
    y = tie(y, summaries)
    return (y, finals) if return_final_states else y
