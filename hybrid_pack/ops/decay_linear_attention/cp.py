"""Decay linear attention on one rank's slice of a row split across a context-parallel group (docs/api.md §10).

Over one segment the state goes through a scalar map per head: ``S_out = e^{Γ} S_in + S0``, with ``Γ`` the sum of
the segment's log decays and ``S0`` its final state from zero. A state ``S_in`` carried into the rank's first
segment adds ``scale e^{γ_t} q_t^T S_in`` to its output at token ``t`` (``γ_t``: the log decays summed up to ``t``)
and ``e^{Γ} S_in`` to its final state: one product per token, no second pass. Any backend of the op serves the
local part.

Each rank all-gathers ``(S0 of its last segment, e^Γ of its first)`` and folds what precedes it
(:mod:`hybrid_pack.ops.cp.state_passing`). Exchanged per rank: ``world_size * H * (K * V + 1)`` numbers,
whatever the row length.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.ops.cp.state_passing import (
    fold,
    gather_summaries,
    segment_initial_states,
    segments_as_documents,
    state_chain,
    tie,
)
from hybrid_pack.ops.dispatch.discovery import recording_keys
from hybrid_pack.ops.validate import state_dtype, without_autocast

__all__ = ["decay_linear_attention_cp"]


@without_autocast
def decay_linear_attention_cp(op: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], q: torch.Tensor,
                              k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, boundaries: ShardedBoundaries, *,
                              scale: float, initial_state: torch.Tensor | None, output_final_state: bool,
                              backend: str | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's part of :func:`hybrid_pack.ops.decay_linear_attention` on the whole row (pure torch around the
    single-device op with ``backend``).

    Args:
        op: the public single-device op (called with plain boundaries and ``backend``).
        q, k: ``[1, T_local, H, K]``; v ``[1, T_local, H, V]``; g ``[1, T_local, H]``.
        boundaries: this rank's :class:`ShardedBoundaries`.
        initial_state: ``[N_local, H, K, V]`` for the local documents. A document's initial state belongs to the
            rank where it starts: the entry of a first document continuing from the previous rank is not used.
        output_final_state: also return ``[N_local, H, K, V]``: each local document's state after its last token
            on this rank (its final state when it ends here, the state handed on when it continues).

    Returns:
        ``(o [1, T_local, H, V], final states or None)``, as the op on the whole row restricted to this rank.
    """
    boundaries.check_group()
    local_op, local = functools.partial(op, backend=backend), boundaries.local
    if recording_keys() and q.shape[1]:
        # the warm-up's discovery pass: the single-device calls of every layout (no state crossing a rank edge: the
        # caller's; an edge cutting a document: final states, states in float32), met on the first token, as later
        # rows make them whatever this row's edges
        one, first = PackedBoundaries.from_lengths([1], q.device), [t[:, :1] for t in (q, k, v, g)]
        state = None if initial_state is None else initial_state.new_zeros(1, *initial_state.shape[1:])
        local_op(*first, one, scale=scale, initial_state=state, output_final_state=output_final_state)
        local_op(*first, one, scale=scale, initial_state=None if state is None else state.to(state_dtype(v.dtype)),
                 output_final_state=True)
    chain = state_chain(boundaries)
    if not chain.exchanges:
        return local_op(q, k, v, g, local, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state)

    num_heads, k_dim, v_dim = v.shape[2], k.shape[3], v.shape[3]
    dtype_of_states = state_dtype(v.dtype)
    starts = segment_initial_states(initial_state, boundaries, dtype_of_states)
    o, finals = local_op(q, k, v, g, segments_as_documents(boundaries), scale=scale, initial_state=starts,
                         output_final_state=True)
    first = local.segment_lengths[0]
    gamma = g[0, :first].to(dtype_of_states).cumsum(0)                    # [first, H]
    if boundaries.continues_from_previous:
        transition = gamma[-1].exp()                                       # [H]
    else:
        transition = finals.new_zeros(num_heads)

    summaries = gather_summaries(torch.cat([finals[-1].flatten(), transition]), boundaries)
    state_size = num_heads * k_dim * v_dim

    def unpack(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        last, decay = row.split([state_size, num_heads])
        return last.view(num_heads, k_dim, v_dim), decay

    incoming = fold(chain, summaries, unpack, lambda decay, state: decay[:, None, None] * state)  # [H, K, V] or None
    if incoming is not None:
        q_decayed = scale * gamma.exp().unsqueeze(-1) * q[0, :first].to(dtype_of_states)      # [first, H, K]
        correction = torch.einsum("thk,hkv->thv", q_decayed, incoming).to(o.dtype)
        o = torch.cat([o[:, :first] + correction, o[:, first:]], dim=1)
        finals = torch.cat([finals[:1] + transition[:, None, None] * incoming, finals[1:]])
    o = tie(o, summaries)
    return o, finals[: local.num_docs] if output_final_state else None
