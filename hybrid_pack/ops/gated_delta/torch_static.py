"""The gated delta rule on :class:`StaticBoundaries`: static shapes, no host read, traced inline by ``torch.compile``.

The maths is :mod:`~hybrid_pack.ops.gated_delta.torch_backend`'s chunked WY form, but the *row* is cut into
``N = ceil(T / C)`` chunks of ``C`` tokens whatever the documents, so a chunk may hold the end of one segment,
whole segments and the start of another. Inside a chunk, with ``γ'_i`` the cumulative log decay of token ``i``
since the start of its segment or of the chunk (whichever is later), and ``same_ij`` "``j <= i`` in the same
segment":

    A_ij = β_i e^{γ'_i - γ'_j} k_i·k_j  (same_ij, j < i),     M_ij = q_i·k_j e^{γ'_i - γ'_j}  (same_ij),
    U = (I + A)^{-1} (β ⊙ V),   W = (I + A)^{-1} ((β e^{γ'}) ⊙ K),

so ``A`` is block diagonal by segment and every token ``i`` sees only its segment's starting state ``S0_i``:
the state carried in from the previous chunk when its segment continues from there (the mask ``carried``),
else its segment slot's initial state (zero without one):

    δ = U - W S0,    O = (e^{γ'} ⊙ Q) S0 + M δ.

The carried state leaving chunk ``n`` is the state of the chunk's last segment:
``S_{n+1} = e^{γ'_C} S0_C + (e^{γ'_C - γ'} ⊙ K ⊙ last)^T δ``, which with ``δ = U - W S_n`` on the carried rows is
the affine map ``S_{n+1} = P_n S_n + B_n``: the scan over the ``N`` chunks is one ``baddbmm`` per chunk, every
other product batched over all chunks before or after it. The initial states enter
only the chunk where their segment starts, through a gather by ``seq_idx`` (skipped without initial states).
Each slot's final state is rebuilt from the chunk holding its last token (``cu_seqlens[1:] - 1``), ``O(S C)``.

Pad tokens (``T`` up to a multiple of ``C``) carry ``g = β = k = q = 0`` and continue the last segment: they
change no state and their outputs are dropped.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.gated_delta.torch_backend import CHUNK_SIZE, l2norm
from hybrid_pack.ops.validate import without_autocast

__all__ = ["gated_delta_rule"]


def _row_chunks(x: torch.Tensor, num_chunks: int, chunk_size: int, num_heads: int) -> torch.Tensor:
    """``[Tp, H * G, ...]`` -> ``[N, H, G, C, ...]``; head ``h * G + j`` lands at ``[h, j]``."""
    return x.reshape(num_chunks, chunk_size, num_heads, -1, *x.shape[2:]).movedim(1, 3)


def _per_slot_from_start(x: torch.Tensor, states: torch.Tensor, start_chunk: torch.Tensor,
                         segment: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """``x_i S0_i`` for the tokens that start from their slot's initial state, zero for the others.

    ``x [N, H, G, C, K]``, ``states [S, H, G, K, V]``, ``start_chunk [S]`` (the chunk where each slot starts),
    ``segment [N, C]`` (each token's slot), ``fresh [N, 1, 1, C, 1]``. Returns ``[N, H, G, C, V]``. A token not
    carried in lies in its slot's start chunk, so each slot's products with its own start chunk are all it reads.
    """
    by_slot = (x[start_chunk] @ states).movedim(3, 1)                                # [S, C, H, G, V]
    positions = torch.arange(segment.shape[1], device=segment.device)
    return by_slot[segment, positions].movedim(1, 3) * fresh                         # [N, H, G, C, V]


@without_autocast
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     boundaries: StaticBoundaries, *, scale: float, initial_state: torch.Tensor | None,
                     output_final_state: bool, use_qk_l2norm: bool, chunk_size: int = CHUNK_SIZE
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule over a static row, the state reset at every segment start.

    Args:
        q, k: ``[1, T, H, K]``.
        v: ``[1, T, HV, V]``; value head ``j`` reads q/k head ``j // (HV // H)``.
        g, beta: ``[1, T, HV]`` log decay and write strength.
        boundaries: the row's segment slots (documents, the padding segment, unused zero-length slots).
        scale: multiplies ``q``.
        initial_state: ``[S, HV, K, V]``, one per segment slot, or None for zeros.
        output_final_state: also return every slot's final state (a zero-length slot's is its initial state).
        use_qk_l2norm: L2-normalise q and k over K first.
        chunk_size: tokens per row chunk ``C``.

    Returns:
        ``o [1, T, HV, V]`` in v's dtype, and the final states ``[S, HV, K, V]`` (float32, float64 for float64
        inputs) or None. Half and bfloat16 inputs are computed in float32.
    """
    num_slots = boundaries.num_segments
    num_heads, k_dim = q.shape[2], q.shape[3]
    num_v_heads, v_dim = v.shape[2], v.shape[3]
    if initial_state is not None and tuple(initial_state.shape) != (num_slots, num_v_heads, k_dim, v_dim):
        raise InputError(f"initial_state: expected one state per segment slot, shape "
                         f"{[num_slots, num_v_heads, k_dim, v_dim]} (boundaries.num_segments first); "
                         f"got {list(initial_state.shape)}")
    out_dtype = v.dtype
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    group = num_v_heads // num_heads
    total = q.shape[1]
    num_chunks = -(-total // chunk_size)
    pad = num_chunks * chunk_size - total
    device = q.device

    q, k, v, g, beta = (torch.nn.functional.pad(x[0].to(dtype), (0, 0) * (x.dim() - 2) + (0, pad))
                        for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    qc = _row_chunks(q * scale, num_chunks, chunk_size, num_heads)  # [N, H, 1, C, K]
    kc = _row_chunks(k, num_chunks, chunk_size, num_heads)          # [N, H, 1, C, K]
    vc = _row_chunks(v, num_chunks, chunk_size, num_heads)          # [N, H, G, C, V]
    gc = _row_chunks(g, num_chunks, chunk_size, num_heads)          # [N, H, G, C]
    bc = _row_chunks(beta, num_chunks, chunk_size, num_heads)       # [N, H, G, C]

    # Each token's slot; pad tokens continue the last one. `carried`: the token's segment was running at the
    # end of the previous chunk, so it starts from the carried state.
    seq_idx = boundaries.seq_idx[0].long()
    segment = torch.cat([seq_idx, seq_idx[-1:].expand(pad)]).view(num_chunks, chunk_size)     # [N, C]
    carried = torch.cat([torch.zeros_like(segment[:1], dtype=torch.bool), segment[1:] == segment[:-1, -1:]])
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()
    same = (segment.unsqueeze(-1) == segment.unsqueeze(-2)) & causal                          # [N, C, C]
    same = same[:, None, None]                                                               # [N, 1, 1, C, C]
    row_carried = carried[:, None, None, :, None].to(dtype)                                  # [N, 1, 1, C, 1]

    # Intra-chunk parts of every chunk at once (names as in the module docstring).
    gamma = same.to(dtype) @ gc.unsqueeze(-1)                                                 # [N, H, G, C, 1]
    pair_decay = (gamma - gamma.mT).masked_fill(~same, float("-inf")).exp()                  # [N, H, G, C, C]
    a = (bc.unsqueeze(-1) * (kc @ kc.mT) * pair_decay).tril(-1)
    rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc.unsqueeze(-1) * gamma.exp()) * kc], dim=-1)
    # (I + A) X = R solved as X^T (I + A)^T = R^T (LAPACK is faster on this layout).
    uw = torch.linalg.solve_triangular(a.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    u, w = uw.split([v_dim, k_dim], dim=-1)                                                  # [N, H, G, C, V | K]
    m = (qc @ kc.mT) * pair_decay                                                            # [N, H, G, C, C]
    q_decayed = qc * gamma.exp()                                                             # [N, H, G, C, K]
    chunk_decay = gamma[..., -1:, :].exp()                                                   # [N, H, G, 1, 1]
    k_to_end_t = (pair_decay[..., -1, :].unsqueeze(-1) * kc).mT                              # [N, H, G, K, C]
    w_carried = w * row_carried
    last_carried = row_carried[..., -1:, :]                                                  # [N, 1, 1, 1, 1]

    cu_seqlens = boundaries.cu_seqlens.long()
    states = None
    if initial_state is not None:
        states = initial_state.to(dtype).reshape(num_slots, num_heads, group, k_dim, v_dim)
        start_chunk = (cu_seqlens[:-1] // chunk_size).clamp(max=num_chunks - 1)
        fresh = 1 - row_carried
        u = u - _per_slot_from_start(w, states, start_chunk, segment, fresh)

    # The scan: S_{n+1} = P_n S_n + B_n from S_0 = 0 (heads flattened: one baddbmm per chunk).
    step_bias = k_to_end_t[:-1] @ u[:-1]                                                     # [N-1, H, G, K, V]
    if states is not None:
        step_bias = step_bias + (1 - last_carried[:-1]) * chunk_decay[:-1] * states[segment[:-1, -1]]
    eye = torch.eye(k_dim, dtype=dtype, device=device)
    step_map = last_carried[:-1] * chunk_decay[:-1] * eye - k_to_end_t[:-1] @ w_carried[:-1]  # [N-1, H, G, K, K]
    # unbind, not indexing: the backward of N - 1 single-chunk selects would write N - 1 full-size gradients.
    step_bias, step_map = step_bias.flatten(1, 2).unbind(0), step_map.flatten(1, 2).unbind(0)
    entering = [torch.zeros(num_v_heads, k_dim, v_dim, dtype=dtype, device=device)]
    for n in range(num_chunks - 1):
        entering.append(step_bias[n] if n == 0 else torch.baddbmm(step_bias[n], step_map[n], entering[-1]))
    entering = torch.stack(entering).unflatten(1, (num_heads, group))                       # [N, H, G, K, V]

    delta = u - w_carried @ entering                                                         # [N, H, G, C, V]
    o = (q_decayed * row_carried) @ entering + m @ delta
    if states is not None:
        o = o + _per_slot_from_start(q_decayed, states, start_chunk, segment, fresh)
    o = o.movedim(3, 1).reshape(num_chunks * chunk_size, num_v_heads, v_dim)[:total]
    o = o.to(out_dtype).unsqueeze(0)
    if not output_final_state:
        return o, None

    # Each slot's state right after its last token, rebuilt in the chunk holding it.
    end = (cu_seqlens[1:] - 1).clamp(min=0)
    end_chunk, end_pos = end // chunk_size, end % chunk_size
    came_in = (cu_seqlens[:-1] < end_chunk * chunk_size).to(dtype)[:, None, None, None, None]
    start = entering[end_chunk] * came_in                                                    # [S, H, G, K, V]
    if states is not None:
        start = start + (1 - came_in) * states
    decay_to_end = pair_decay[end_chunk, :, :, end_pos]                                      # [S, H, G, C]
    final = (gamma[end_chunk, :, :, end_pos].exp().unsqueeze(-1) * start
             + (decay_to_end.unsqueeze(-1) * kc[end_chunk]).mT @ delta[end_chunk])
    nonempty = (cu_seqlens[1:] > cu_seqlens[:-1])[:, None, None, None, None]
    final = torch.where(nonempty, final, torch.zeros_like(final) if states is None else states)
    return o, final.reshape(num_slots, num_v_heads, k_dim, v_dim)
