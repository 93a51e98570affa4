"""Dense masked attention over the whole packed row: quadratic in T, for tests only."""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                         causal: bool = True, softmax_scale: float | None = None, window: None = None) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` with a ``[T, T]`` mask allowing only same-segment (earlier) keys (no
    sliding ``window``: the windowed tests hold their own reference).

    q ``[1, T, H, D]``, k/v ``[1, T, Hkv, D]`` -> ``[1, T, H, D]`` in q's dtype; computed in float64.
    """
    assert window is None, "the dense reference has no sliding window"
    num_heads, num_kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
    group = num_heads // num_kv_heads
    q64, k64, v64 = (t[0].double().transpose(0, 1) for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(group, dim=0), v64.repeat_interleave(group, dim=0)
    seq = boundaries.seq_idx[0].to(q.device)
    allowed = seq[:, None] == seq[None, :]
    if causal:
        allowed = allowed & torch.ones_like(allowed).tril()
    scores = (q64 @ k64.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v64
    return out.transpose(0, 1).unsqueeze(0).to(q.dtype)
