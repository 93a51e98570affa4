"""Decay linear attention in chunked form: exact on packed rows, forward and backward, pure torch.

The recurrence ``S_t = e^{g_t} S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t`` (``S [K, V]`` per head). Every
segment is cut into chunks of ``CHUNK_SIZE`` tokens (:meth:`PackedBoundaries.chunk_layout`), so no chunk straddles
two documents. Inside one chunk, with local positions ``i = 1..C`` and ``γ_i = g_1 + ... + g_i``,

    O   = (e^γ ⊙ Q) S_0 + (Q K^T ⊙ D) V,     D_ij = e^{γ_i - γ_j}  (j <= i), 0 otherwise,
    S_C = e^{γ_C} S_0 + (e^{γ_C - γ} ⊙ K)^T V

(``q`` already multiplied by ``scale``): MiniMax's lightning attention blocks (its query, key and diagonal decays
are ``e^γ``, ``e^{γ_C - γ}`` and ``D`` for a constant ``g``). The intra-chunk parts of all chunks of all documents
are computed at once; the scan over chunk steps (``ceil(max_seqlen / C)`` of them) costs two batched products per
step over the segments still running. A masked slot (the tail of a document's last chunk) holds
``g = k = q = v = 0``: decay 1, no write, so it changes neither the state nor any output.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import ChunkLayout, PackedBoundaries
from hybrid_pack.ops.validate import without_autocast

__all__ = ["CHUNK_SIZE", "decay_linear_attention"]

CHUNK_SIZE = 32


def _heads_first(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``[T, H, ...]`` -> chunk rows ``[M, H, C, ...]``."""
    return layout.to_chunks(x).movedim(1, 2)


def _start_states(initial_state: torch.Tensor | None, boundaries: PackedBoundaries, layout: ChunkLayout,
                  shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Each segment's starting state ``[S, H, K, V]``, ranked by ``layout.order``."""
    num_segments = boundaries.num_segments
    if initial_state is None:
        return torch.zeros(num_segments, *shape, dtype=dtype, device=device)
    states = initial_state.to(dtype)
    if num_segments > boundaries.num_docs:
        states = torch.cat([states, states.new_zeros(num_segments - boundaries.num_docs, *shape)])
    return states[layout.order]


@without_autocast
def decay_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           boundaries: PackedBoundaries, *, scale: float, initial_state: torch.Tensor | None,
                           output_final_state: bool, chunk_size: int = CHUNK_SIZE
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked decay linear attention with the state reset at every document start.

    Args:
        q, k: ``[1, T, H, K]``.
        v: ``[1, T, H, V]``.
        g: ``[1, T, H]`` log decay (<= 0).
        boundaries: segments of the row; the trailing padding segment (if any) starts from zero.
        scale: multiplies ``q``.
        initial_state: ``[N, H, K, V]`` per real document, or None for zeros.
        output_final_state: also return each document's final state.
        chunk_size: tokens per chunk (the public op always uses ``CHUNK_SIZE``).

    Returns:
        ``o [1, T, H, V]`` in v's dtype, and the final states ``[N, H, K, V]`` (float32, float64 for float64
        inputs) or None. Half and bfloat16 inputs are computed in float32.
    """
    out_dtype = v.dtype
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    num_heads, k_dim, v_dim = q.shape[2], q.shape[3], v.shape[3]
    layout = boundaries.chunk_layout(chunk_size)

    q, k, v, g = (x[0].to(dtype) for x in (q, k, v, g))
    qc = _heads_first(q * scale, layout)   # [M, H, C, K]
    kc = _heads_first(k, layout)           # [M, H, C, K]
    vc = _heads_first(v, layout)           # [M, H, C, V]
    gamma = _heads_first(g, layout).cumsum(-1)  # [M, H, C]
    gamma_last = gamma[..., -1:]

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    intra = ((qc @ kc.mT) * pair_decay) @ vc                               # [M, H, C, V]
    q_decayed = qc * gamma.exp().unsqueeze(-1)                             # [M, H, C, K]
    kv = ((gamma_last - gamma).exp().unsqueeze(-1) * kc).mT @ vc           # [M, H, K, V]
    chunk_decay = gamma_last.exp().unsqueeze(-1)                           # [M, H, 1, 1]

    # Scan over chunk steps; the segments running at a step are the first `n` ranked states.
    state = _start_states(initial_state, boundaries, layout, (num_heads, k_dim, v_dim), dtype, q.device)
    active = [layout.active(step) for step in range(layout.num_steps)]
    outputs = []
    for n, q_decayed_k, kv_k, chunk_decay_k in zip(active, *(x.split(active) for x in (q_decayed, kv, chunk_decay))):
        running, finished = state.split([n, state.shape[0] - n])
        outputs.append(q_decayed_k @ running)
        state = torch.cat([chunk_decay_k * running + kv_k, finished])
    o = torch.cat(outputs) + intra                                         # [M, H, C, V]
    o = layout.from_chunks(o.movedim(2, 1)).to(out_dtype).unsqueeze(0)    # [1, T, H, V]
    if not output_final_state:
        return o, None
    return o, state[layout.rank_of_segment[: boundaries.num_docs]]
