"""torch adapter: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10, CUDA flash kernel) with ``cu_seqlens``.

Same argument forms as flash-attn: ``[T, H, D]`` rows, int32 ``cu_seq_q = cu_seq_k`` and Python-int
maximum lengths. Causal masking is ``window_size=(-1, 0)``; grouped-query attention is
``enable_gqa``. On CPU the op has no kernel (``aten::_flash_attention_forward`` is CUDA only).
"""

from __future__ import annotations

import importlib.util

import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["varlen_attention", "varlen_attn_probe"]

CAUSAL_WINDOW = (-1, 0)
FULL_WINDOW = (-1, -1)


def varlen_attn_probe() -> str:
    """"" if this torch has ``torch.nn.attention.varlen.varlen_attn``, else why not."""
    try:
        found = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ImportError:
        found = False
    return "" if found else f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.10)"


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                     causal: bool, softmax_scale: float) -> torch.Tensor:
    """:func:`hybrid_pack.ops.varlen_attention` through ``varlen_attn(cu_seq_q=cu_seq_k=cu_seqlens)``."""
    from torch.nn.attention.varlen import varlen_attn

    cu_seqlens, max_seqlen = boundaries.cu_seqlens, boundaries.max_seqlen
    out = varlen_attn(q[0], k[0], v[0], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=softmax_scale,
                      window_size=CAUSAL_WINDOW if causal else FULL_WINDOW, enable_gqa=q.shape[2] != k.shape[2])
    return out.unsqueeze(0)
