"""Per-token Kimi Delta Attention, one segment at a time: the oracle for the chunked backends.

Straight from the definition (as transformers' ``recurrent_kimi_delta_attention`` steps it): for every token,
``S = diag(e^g) S`` (one decay per key channel), then ``S += β k (v - S^T k)^T``, then ``o = scale S^T q``.
Slow on purpose (a Python loop over tokens); differentiable.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries

L2NORM_EPS = 1e-6


def kda_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  boundaries: PackedBoundaries, *, scale: float | None = None,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = True,
                  use_qk_l2norm: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Arguments and shapes as :func:`hybrid_pack.ops.kda`.

    Returns ``(o [1, T, HV, V] in v's dtype, final_state [N, HV, K, V] or None)``, computed in float64 for
    float64 inputs and float32 otherwise.
    """
    dtype = torch.float64 if torch.float64 in (q.dtype, v.dtype) else torch.float32
    num_heads, k_dim = q.shape[2], q.shape[3]
    num_v_heads, v_dim = v.shape[2], v.shape[3]
    scale = k_dim ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x[0].to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt(q.square().sum(-1, keepdim=True) + L2NORM_EPS)
        k = k / torch.sqrt(k.square().sum(-1, keepdim=True) + L2NORM_EPS)
    q = q.repeat_interleave(num_v_heads // num_heads, dim=1)
    k = k.repeat_interleave(num_v_heads // num_heads, dim=1)

    outputs, finals = [], []
    segments = zip(*(x.split(boundaries.segment_lengths) for x in (q, k, v, g, beta)))
    for segment, (q_seg, k_seg, v_seg, g_seg, beta_seg) in enumerate(segments):
        if initial_state is not None and segment < boundaries.num_docs:
            state = initial_state[segment].to(dtype)
        else:
            state = torch.zeros(num_v_heads, k_dim, v_dim, dtype=dtype, device=v.device)
        for q_t, k_t, v_t, g_t, beta_t in zip(*(x.unbind(0) for x in (q_seg, k_seg, v_seg, g_seg, beta_seg))):
            state = g_t.exp()[:, :, None] * state
            recalled = (state * k_t[:, :, None]).sum(1)
            state = state + k_t[:, :, None] * (beta_t[:, None] * (v_t - recalled))[:, None, :]
            outputs.append(scale * (state * q_t[:, :, None]).sum(1))
        if segment < boundaries.num_docs:
            finals.append(state)
    return torch.stack(outputs).unsqueeze(0).to(v.dtype), torch.stack(finals) if output_final_state else None
