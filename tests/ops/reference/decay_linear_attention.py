"""Per-token decay linear attention, one segment at a time: the oracle for the chunked backends.

Straight from the definition: for every token, ``S = e^g S + k v^T``, then ``o = scale S^T q``. Slow on purpose
(a Python loop over tokens); differentiable.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries


def decay_linear_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     boundaries: PackedBoundaries, *, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None, output_final_state: bool = True
                                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Arguments and shapes as :func:`hybrid_pack.ops.decay_linear_attention` (``g`` per token, ``[1, T, H]``).

    Returns ``(o [1, T, H, V] in v's dtype, final_state [N, H, K, V] or None)``, computed in float64 for float64
    inputs and float32 otherwise.
    """
    dtype = torch.float64 if torch.float64 in (q.dtype, v.dtype) else torch.float32
    num_heads, k_dim, v_dim = q.shape[2], q.shape[3], v.shape[3]
    scale = k_dim ** -0.5 if scale is None else scale
    q, k, v, g = (x[0].to(dtype) for x in (q, k, v, g))
    outputs, finals = [], []
    for segment, (q_seg, k_seg, v_seg, g_seg) in enumerate(zip(*(x.split(boundaries.segment_lengths)
                                                                 for x in (q, k, v, g)))):
        if initial_state is not None and segment < boundaries.num_docs:
            state = initial_state[segment].to(dtype)
        else:
            state = torch.zeros(num_heads, k_dim, v_dim, dtype=dtype, device=v.device)
        for q_t, k_t, v_t, g_t in zip(*(x.unbind(0) for x in (q_seg, k_seg, v_seg, g_seg))):
            state = g_t.exp()[:, None, None] * state + k_t[:, :, None] * v_t[:, None, :]
            outputs.append(scale * (state * q_t[:, :, None]).sum(1))
        if segment < boundaries.num_docs:
            finals.append(state)
    return torch.stack(outputs).unsqueeze(0).to(v.dtype), torch.stack(finals) if output_final_state else None
