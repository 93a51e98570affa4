"""The gated delta rule in chunked WY form: exact on packed rows, forward and backward, pure torch.

Every segment is cut into chunks of ``CHUNK_SIZE`` tokens (:meth:`PackedBoundaries.chunk_layout`),
so no chunk straddles two documents. Inside one chunk, with local positions ``i = 1..C`` and the
cumulative log decay ``γ_i = g_1 + ... + g_i``, the recurrence unrolls to

    S_i = e^{γ_i} S_0 + Σ_{j <= i} e^{γ_i - γ_j} k_j δ_j^T,
    (I + A) δ = β ⊙ V - (β e^γ) ⊙ K S_0,   A_ij = β_i e^{γ_i - γ_j} k_i·k_j  (j < i),

so with ``U = (I + A)^{-1} (β ⊙ V)`` and ``W = (I + A)^{-1} ((β e^γ) ⊙ K)`` (the WY / UT form),
``δ = U - W S_0`` and

    S_C = e^{γ_C} S_0 + (e^{γ_C - γ} ⊙ K)^T δ,
    O   = (e^γ ⊙ Q) S_0 + M δ,     M_ij = q_i·k_j e^{γ_i - γ_j}  (j <= i).

(``q`` already multiplied by ``scale``). ``A``, ``U``, ``W`` and ``M`` are computed for all chunks of
all documents at once; the scan over chunk steps (``ceil(max_seqlen / C)`` of them) then costs four
batched products per step over the segments still running, however many documents the row holds.

A masked slot (the tail of a document's last chunk) carries ``g = β = k = q = 0``: its decay is 1
and its rows of ``U`` and ``W`` are zero, so it changes neither the state nor any output.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import ChunkLayout, PackedBoundaries
from hybrid_pack.ops.validate import without_autocast

__all__ = ["CHUNK_SIZE", "L2NORM_EPS", "gated_delta_rule", "l2norm"]

CHUNK_SIZE = 32
L2NORM_EPS = 1e-6  # flash-linear-attention's l2norm: x / sqrt(sum(x^2) + eps)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim (flash-linear-attention's ``l2norm``)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def _heads_first(x: torch.Tensor, layout: ChunkLayout, num_heads: int) -> torch.Tensor:
    """``[T, H * G, ...]`` -> chunk rows ``[M, H, G, C, ...]``; head ``h * G + j`` lands at ``[h, j]``."""
    chunks = layout.to_chunks(x).unflatten(2, (num_heads, -1))
    return chunks.movedim(1, 3)


def _start_states(initial_state: torch.Tensor | None, boundaries: PackedBoundaries, layout: ChunkLayout,
                  shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each segment's starting state ``[S, H, G, K, V]``, ranked by ``layout.order``."""
    num_segments = boundaries.num_segments
    if initial_state is None:
        return torch.zeros(num_segments, *shape, dtype=dtype, device=device)
    states = initial_state.to(dtype).reshape(boundaries.num_docs, *shape)
    if num_segments > boundaries.num_docs:
        states = torch.cat([states, states.new_zeros(num_segments - boundaries.num_docs, *shape)])
    return states[layout.order]


@without_autocast
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     boundaries: PackedBoundaries, *, scale: float, initial_state: torch.Tensor | None,
                     output_final_state: bool, use_qk_l2norm: bool, chunk_size: int = CHUNK_SIZE
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked gated delta rule with the state reset at every document start.

    Args:
        q, k: ``[1, T, H, K]``.
        v: ``[1, T, HV, V]``; value head ``j`` reads q/k head ``j // (HV // H)`` (flash-linear-attention's
            GVA convention).
        g, beta: ``[1, T, HV]`` log decay and write strength.
        boundaries: segments of the row; the trailing padding segment (if any) starts from zero.
        scale: multiplies ``q``.
        initial_state: ``[N, HV, K, V]`` per real document, or None for zeros.
        output_final_state: also return each document's final state.
        use_qk_l2norm: L2-normalise q and k over K first.
        chunk_size: tokens per chunk (the public op always uses ``CHUNK_SIZE``).

    Returns:
        ``o [1, T, HV, V]`` in v's dtype, and the final states ``[N, HV, K, V]`` (float32, float64 for
        float64 inputs) or None. Half and bfloat16 inputs are computed in float32.
    """
    out_dtype = v.dtype
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    num_heads, k_dim = q.shape[2], q.shape[3]
    num_v_heads, v_dim = v.shape[2], v.shape[3]
    group = num_v_heads // num_heads
    layout = boundaries.chunk_layout(chunk_size)

    q, k, v, g, beta = (x[0].to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    qc = _heads_first(q * scale, layout, num_heads)  # [M, H, 1, C, K]
    kc = _heads_first(k, layout, num_heads)          # [M, H, 1, C, K]
    vc = _heads_first(v, layout, num_heads)          # [M, H, G, C, V]
    gc = _heads_first(g, layout, num_heads)          # [M, H, G, C]
    bc = _heads_first(beta, layout, num_heads)       # [M, H, G, C]

    # Intra-chunk parts of every chunk row at once (names as in the module docstring).
    gamma = gc.cumsum(-1)
    gamma_last = gamma[..., -1:]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    a = (bc.unsqueeze(-1) * (kc @ kc.mT) * pair_decay).tril(-1)                       # [M, H, G, C, C]
    rhs = torch.cat([bc.unsqueeze(-1) * vc, (bc * gamma.exp()).unsqueeze(-1) * kc], dim=-1)
    # (I + A) X = R solved as X^T (I + A)^T = R^T: LAPACK is about twice as fast on this layout.
    uw = torch.linalg.solve_triangular(a.mT, rhs.mT, upper=True, left=False, unitriangular=True).mT
    u, w = uw.split([v_dim, k_dim], dim=-1)                                           # [M, H, G, C, V | K]
    m = (qc @ kc.mT) * pair_decay                                                     # [M, H, G, C, C]
    q_decayed = qc * gamma.exp().unsqueeze(-1)                                        # [M, H, G, C, K]
    k_decayed_t = ((gamma_last - gamma).exp().unsqueeze(-1) * kc).mT                  # [M, H, G, K, C]
    chunk_decay = gamma_last.exp().unsqueeze(-1)                                      # [M, H, G, 1, 1]

    # Scan over chunk steps; the segments running at a step are the first `n` ranked states.
    state = _start_states(initial_state, boundaries, layout, (num_heads, group, k_dim, v_dim), dtype, q.device)
    active = [layout.active(step) for step in range(layout.num_steps)]
    per_step = zip(active, *(x.split(active) for x in (u, w, k_decayed_t, chunk_decay, q_decayed, m)))
    outputs = []
    for n, u_k, w_k, k_decayed_t_k, chunk_decay_k, q_decayed_k, m_k in per_step:
        running, finished = state.split([n, state.shape[0] - n])
        delta = u_k - w_k @ running                                                   # [n, H, G, C, V]
        outputs.append(q_decayed_k @ running + m_k @ delta)
        state = torch.cat([chunk_decay_k * running + k_decayed_t_k @ delta, finished])
    o = torch.cat(outputs)                                                            # [M, H, G, C, V]
    o = layout.from_chunks(o.movedim(3, 1).flatten(2, 3)).to(out_dtype).unsqueeze(0)  # [1, T, HV, V]
    if not output_final_state:
        return o, None
    final = state[layout.rank_of_segment[: boundaries.num_docs]]
    return o, final.reshape(boundaries.num_docs, num_v_heads, k_dim, v_dim)
