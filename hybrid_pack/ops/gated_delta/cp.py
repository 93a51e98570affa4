"""The gated delta rule on one rank's slice of a row split across a context-parallel group (docs/api.md §10).

Over one segment the state goes through an affine map, ``S_out = M S_in + S0``, with
``M = prod_t exp(g_t) (I - beta_t k_t k_t^T)`` (``[HV, K, K]``) and ``S0`` the segment's final state
from zero. Only the first local segment can receive a state (when it continues from the previous rank), so
only it needs more than the op: it runs alone with its value columns widened by ``K`` columns of zeros whose
state starts as the identity. Value columns are independent under the delta rule, so the extra columns carry
``P_t I = P_t`` (the map from the segment's start to token ``t``): their final state is ``M``, and their output
at token ``t`` is ``u_t = scale P_t^T q_t``, so the segment's output given an incoming state is
``o_t + S_in^T u_t``, a product per token, no second pass. The other segments run once, unwidened (their
states start from zero or the user's). ``u`` is inherent to folding the incoming state in after the one
all-gather: a second pass over the first segment with ``S_in`` would cost the whole op again. Any backend of
the op serves.

Each rank then all-gathers ``(S0 of its last segment, M of its first)`` and folds what precedes it
(:mod:`hybrid_pack.ops.cp.state_passing`). Exchanged per rank: ``world_size * HV * K * (V + K)``
numbers, whatever the row length.
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

__all__ = ["gated_delta_rule_cp"]


@without_autocast
def gated_delta_rule_cp(op: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], q: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        boundaries: ShardedBoundaries, *, scale: float, initial_state: torch.Tensor | None,
                        output_final_state: bool, use_qk_l2norm: bool, backend: str | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's part of :func:`hybrid_pack.ops.gated_delta_rule` on the whole row.

    The pure-torch path: it runs around the single-device op with ``backend`` when no sharded backend
    (flash-linear-attention's own context parallelism, :mod:`.kernel_fla_cp`) serves the call
    (:mod:`hybrid_pack.ops.dispatch.route`).

    Args:
        op: the public single-device op (called with plain boundaries and ``backend``).
        q, k: ``[1, T_local, H, K]``; v ``[1, T_local, HV, V]``; g, beta ``[1, T_local, HV]``.
        boundaries: this rank's :class:`ShardedBoundaries`.
        initial_state: ``[N_local, HV, K, V]`` for the local documents. A document's initial state belongs
            to the rank where it starts: the entry of a first document continuing from the previous rank
            is not used (its gradient is zero).
        output_final_state: also return ``[N_local, HV, K, V]``: each local document's state after its
            last token on this rank, which is its final state when it ends here and the state handed to
            the next rank when it continues there.

    Returns:
        ``(o [1, T_local, HV, V], final states or None)``, as the op on the whole row restricted to this
        rank (float64 inputs: equal to 1e-10).
    """
    boundaries.check_group()
    local_op, local = functools.partial(op, backend=backend, scale=scale, use_qk_l2norm=use_qk_l2norm), boundaries.local
    if recording_keys() and q.shape[1]:
        _meet_every_layout(local_op, q, k, v, g, beta, initial_state, output_final_state)
    chain = state_chain(boundaries)
    if not chain.exchanges:
        return local_op(q, k, v, g, beta, local, initial_state=initial_state, output_final_state=output_final_state)

    num_v_heads, v_dim, k_dim = v.shape[2], v.shape[3], k.shape[3]
    dtype_of_states = state_dtype(v.dtype)
    starts = segment_initial_states(initial_state, boundaries, dtype_of_states)
    if boundaries.continues_from_previous:
        first, rest = _first_and_rest(boundaries)
        length = local.segment_lengths[0]
        # The first segment alone, its values widened by K zero columns whose state starts as the identity.
        identity = torch.eye(k_dim, dtype=dtype_of_states, device=v.device).expand(1, num_v_heads, k_dim, k_dim)
        widened = torch.cat([v[:, :length], v.new_zeros(1, length, num_v_heads, k_dim)], dim=-1)
        # A continuing document's own initial state is zero (it belongs to the rank where the document starts).
        zero = identity.new_zeros(1, num_v_heads, k_dim, v_dim) if starts is None else starts[:1]
        start = torch.cat([zero, identity], dim=-1)
        o, finals = local_op(q[:, :length], k[:, :length], widened, g[:, :length], beta[:, :length], first,
                             initial_state=start, output_final_state=True)
        (o, u), (finals, maps) = o.split([v_dim, k_dim], dim=-1), finals.split([v_dim, k_dim], dim=-1)
        transition = maps[0]                                              # [HV, K, K]
        if rest is not None:
            o_rest, finals_rest = local_op(q[:, length:], k[:, length:], v[:, length:], g[:, length:],
                                           beta[:, length:], rest, initial_state=None if starts is None else starts[1:],
                                           output_final_state=True)
            o, finals = torch.cat([o, o_rest], dim=1), torch.cat([finals, finals_rest])
    else:
        o, finals = local_op(q, k, v, g, beta, segments_as_documents(boundaries), initial_state=starts,
                             output_final_state=True)
        transition = finals.new_zeros(num_v_heads, k_dim, k_dim)

    summaries = gather_summaries(torch.cat([finals[-1].flatten(), transition.flatten()]), boundaries)
    state_size = num_v_heads * k_dim * v_dim

    def unpack(row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        last, m = row.split([state_size, row.numel() - state_size])
        return last.view(num_v_heads, k_dim, v_dim), m.view(num_v_heads, k_dim, k_dim)

    incoming = fold(chain, summaries, unpack, torch.matmul)               # [HV, K, V] or None
    if incoming is not None:
        length = local.segment_lengths[0]
        correction = torch.einsum("thk,hkv->thv", u[0].to(dtype_of_states), incoming).to(o.dtype)
        o = torch.cat([o[:, :length] + correction, o[:, length:]], dim=1)
        finals = torch.cat([finals[:1] + transition @ incoming, finals[1:]])
    o = tie(o, summaries)
    return o, finals[: local.num_docs] if output_final_state else None


def _meet_every_layout(local_op: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], q: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       initial_state: torch.Tensor | None, output_final_state: bool) -> None:
    """The single-device calls every layout of a row makes (no state crossing a rank edge; a continuing first
    segment, widened; the other segments), each on this rank's first token: in the warm-up's discovery pass
    (:func:`hybrid_pack.backends.verify`) their keys are met, as later rows meet them whatever their edges."""
    one = PackedBoundaries.from_lengths([1], q.device)
    q, k, v, g, beta = (t[:, :1] for t in (q, k, v, g, beta))
    num_v_heads, k_dim, v_dim, dtype = v.shape[2], k.shape[3], v.shape[3], state_dtype(v.dtype)
    state = None if initial_state is None else torch.zeros(1, num_v_heads, k_dim, v_dim, device=v.device)
    local_op(q, k, v, g, beta, one, initial_state=None if state is None else state.to(initial_state.dtype),
             output_final_state=output_final_state)
    local_op(q, k, v, g, beta, one, initial_state=None if state is None else state.to(dtype), output_final_state=True)
    widened = torch.cat([v, v.new_zeros(1, 1, num_v_heads, k_dim)], dim=-1)
    local_op(q, k, widened, g, beta, one, output_final_state=True,
             initial_state=torch.zeros(1, num_v_heads, k_dim, v_dim + k_dim, dtype=dtype, device=v.device))


def _first_and_rest(boundaries: ShardedBoundaries) -> tuple[PackedBoundaries, PackedBoundaries | None]:
    """Plain boundaries of the first local segment alone and of the others (the padding segment counted as a
    document, as in :func:`segments_as_documents`), None when there are none. Kept on ``boundaries``."""
    def build() -> tuple[PackedBoundaries, PackedBoundaries | None]:
        lengths, device = boundaries.local.segment_lengths, boundaries.device
        rest = PackedBoundaries.from_lengths(lengths[1:], device) if len(lengths) > 1 else None
        return PackedBoundaries.from_lengths(lengths[:1], device), rest

    return boundaries.view("gated_delta_first_and_rest", build)
