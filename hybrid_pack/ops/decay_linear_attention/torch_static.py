"""Decay linear attention on :class:`StaticBoundaries`: static shapes, no host read, traced inline by
``torch.compile``.

The maths is :mod:`~hybrid_pack.ops.decay_linear_attention.torch_backend`'s chunked form, but the *row* is cut into
``N = ceil(T / C)`` chunks of ``C`` tokens whatever the documents, so a chunk may hold the end of one segment, whole
segments and the start of another. Inside a chunk, with ``γ'_i`` the cumulative log decay of token ``i`` since the
start of its segment or of the chunk (whichever is later) and ``same_ij`` "``j <= i`` in the same segment",
``D_ij = e^{γ'_i - γ'_j}`` on ``same_ij`` (0 elsewhere) keeps the intra-chunk part block diagonal by segment, and
every token sees only its segment's starting state ``S0_i``: the state carried in from the previous chunk when its
segment continues from there (the mask ``carried``), else its slot's initial state (zero without one):

    O = (e^{γ'} ⊙ Q) S0 + (Q K^T ⊙ D) V.

The state leaving chunk ``n`` is that of the chunk's last segment, ``S_{n+1} = e^{γ'_C} S0_C + (D_{C,:} ⊙ K)^T V``:
with ``S0_C = S_n`` when that segment was carried in, the scan over the ``N`` chunks is one multiply-add per chunk.
Each slot's final state is rebuilt from the chunk holding its last token (``cu_seqlens[1:] - 1``). Pad tokens
(``T`` up to a multiple of ``C``) carry ``g = k = q = v = 0`` and continue the last segment: they change no state
and their outputs are dropped.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.decay_linear_attention.torch_backend import CHUNK_SIZE
from hybrid_pack.ops.validate import without_autocast

__all__ = ["decay_linear_attention"]


def _row_chunks(x: torch.Tensor, num_chunks: int, chunk_size: int) -> torch.Tensor:
    """``[Tp, H, ...]`` -> ``[N, H, C, ...]``."""
    return x.reshape(num_chunks, chunk_size, *x.shape[1:]).movedim(1, 2)


@without_autocast
def decay_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           boundaries: StaticBoundaries, *, scale: float, initial_state: torch.Tensor | None,
                           output_final_state: bool, chunk_size: int = CHUNK_SIZE
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked decay linear attention over a static row, the state reset at every segment start.

    Args:
        q, k: ``[1, T, H, K]``; v: ``[1, T, H, V]``; g: ``[1, T, H]`` log decay.
        boundaries: the row's segment slots (documents, the padding segment, unused zero-length slots).
        scale: multiplies ``q``.
        initial_state: ``[S, H, K, V]``, one per segment slot, or None for zeros.
        output_final_state: also return every slot's final state (a zero-length slot's is its initial state).
        chunk_size: tokens per row chunk ``C``.

    Returns:
        ``o [1, T, H, V]`` in v's dtype, and the final states ``[S, H, K, V]`` (float32, float64 for float64
        inputs) or None. Half and bfloat16 inputs are computed in float32.
    """
    num_slots = boundaries.num_segments
    num_heads, k_dim, v_dim = q.shape[2], q.shape[3], v.shape[3]
    if initial_state is not None and tuple(initial_state.shape) != (num_slots, num_heads, k_dim, v_dim):
        raise InputError(f"initial_state: expected one state per segment slot, shape "
                         f"{[num_slots, num_heads, k_dim, v_dim]} (boundaries.num_segments first); "
                         f"got {list(initial_state.shape)}")
    out_dtype = v.dtype
    dtype = torch.promote_types(torch.promote_types(q.dtype, v.dtype), torch.float32)
    total = q.shape[1]
    num_chunks = -(-total // chunk_size)
    pad = num_chunks * chunk_size - total
    device = q.device

    q, k, v, g = (torch.nn.functional.pad(x[0].to(dtype), (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g))
    qc = _row_chunks(q * scale, num_chunks, chunk_size)   # [N, H, C, K]
    kc = _row_chunks(k, num_chunks, chunk_size)           # [N, H, C, K]
    vc = _row_chunks(v, num_chunks, chunk_size)           # [N, H, C, V]
    gc = _row_chunks(g, num_chunks, chunk_size)           # [N, H, C]

    # Each token's slot; pad tokens continue the last one. `carried`: the token's segment was running at the end
    # of the previous chunk, so it starts from the carried state.
    seq_idx = boundaries.seq_idx[0].long()
    segment = torch.cat([seq_idx, seq_idx[-1:].expand(pad)]).view(num_chunks, chunk_size)     # [N, C]
    carried = torch.cat([torch.zeros_like(segment[:1], dtype=torch.bool), segment[1:] == segment[:-1, -1:]])
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()
    same = ((segment.unsqueeze(-1) == segment.unsqueeze(-2)) & causal)[:, None]              # [N, 1, C, C]
    row_carried = carried[:, None, :, None].to(dtype)                                        # [N, 1, C, 1]

    gamma = same.to(dtype) @ gc.unsqueeze(-1)                                                 # [N, H, C, 1]
    pair_decay = (gamma - gamma.mT).masked_fill(~same, float("-inf")).exp()                  # [N, H, C, C]
    intra = ((qc @ kc.mT) * pair_decay) @ vc                                                 # [N, H, C, V]
    q_decayed = qc * gamma.exp()                                                             # [N, H, C, K]
    chunk_decay = gamma[..., -1:, :].exp()                                                   # [N, H, 1, 1]
    kv_to_end = (pair_decay[..., -1, :].unsqueeze(-1) * kc).mT @ vc                          # [N, H, K, V]
    last_carried = row_carried[..., -1:, :]                                                  # [N, 1, 1, 1]

    cu_seqlens = boundaries.cu_seqlens.long()
    states = None
    if initial_state is not None:
        states = initial_state.to(dtype)
        start_chunk = (cu_seqlens[:-1] // chunk_size).clamp(max=num_chunks - 1)
        # Each token's product with its slot's initial state, kept where the token starts from it.
        by_slot = (q_decayed[start_chunk] @ states).movedim(2, 1)                            # [S, C, H, V]
        from_start = by_slot[segment, torch.arange(chunk_size, device=device)].movedim(1, 2)  # [N, H, C, V]
        intra = intra + from_start * (1 - row_carried)  # a token not carried in lies in its slot's start chunk

    # The scan: S_{n+1} = a_n S_n + b_n from S_0 = 0.
    step_bias = kv_to_end[:-1]
    if states is not None:
        step_bias = step_bias + (1 - last_carried[:-1]) * chunk_decay[:-1] * states[segment[:-1, -1]]
    step_decay = (last_carried[:-1] * chunk_decay[:-1]).unbind(0)
    step_bias = step_bias.unbind(0)
    entering = [torch.zeros(num_heads, k_dim, v_dim, dtype=dtype, device=device)]
    for n in range(num_chunks - 1):
        entering.append(step_bias[n] if n == 0 else torch.addcmul(step_bias[n], step_decay[n], entering[-1]))
    entering = torch.stack(entering)                                                         # [N, H, K, V]

    o = (q_decayed * row_carried) @ entering + intra
    o = o.movedim(2, 1).reshape(num_chunks * chunk_size, num_heads, v_dim)[:total].to(out_dtype).unsqueeze(0)
    if not output_final_state:
        return o, None

    # Each slot's state right after its last token, rebuilt in the chunk holding it.
    end = (cu_seqlens[1:] - 1).clamp(min=0)
    end_chunk, end_pos = end // chunk_size, end % chunk_size
    came_in = (cu_seqlens[:-1] < end_chunk * chunk_size).to(dtype)[:, None, None, None]
    start = entering[end_chunk] * came_in                                                    # [S, H, K, V]
    if states is not None:
        start = start + (1 - came_in) * states
    decay_to_end = pair_decay[end_chunk, :, end_pos]                                         # [S, H, C]
    final = (gamma[end_chunk, :, end_pos].exp().unsqueeze(-1) * start
             + (decay_to_end.unsqueeze(-1) * kc[end_chunk]).mT @ vc[end_chunk])
    nonempty = (cu_seqlens[1:] > cu_seqlens[:-1])[:, None, None, None]
    final = torch.where(nonempty, final, torch.zeros_like(final) if states is None else states)
    return o, final
