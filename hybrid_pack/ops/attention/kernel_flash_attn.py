"""flash-attn adapter: ``flash_attn_varlen_func`` with ``cu_seqlens``.

The packed row ``[1, T, H, D]`` becomes flash-attn's ``[T, H, D]`` with int32 ``cu_seqlens`` for
queries and keys and the Python-int ``max_seqlen`` (a tensor would sync the host). Grouped-query
attention is native: k/v keep their ``Hkv`` heads. The padding segment is its own sequence.
flash-attn takes float16 / bfloat16 only and head dims up to 256. A sliding window of ``window`` keys is
``window_size=(window - 1, 0)``: flash's left reach is inclusive of the ``window - 1`` keys before the token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.attention.kernel_torch_varlen import window_size

__all__ = ["varlen_attention", "flash_attn_accepts", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256


def flash_attn_accepts(inputs: Mapping[str, Any]) -> str:
    """"" if ``flash_attn_varlen_func`` takes these attention inputs, else why not."""
    head_dim = inputs["q"].shape[-1]
    if head_dim > MAX_HEAD_DIM:
        return f"flash_attn_varlen_func takes head dims up to {MAX_HEAD_DIM}; got {head_dim}"
    return ""


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                     causal: bool, softmax_scale: float, window: int | None = None) -> torch.Tensor:
    """:func:`hybrid_pack.ops.varlen_attention` through ``flash_attn_varlen_func(cu_seqlens_q=cu_seqlens_k=...)``."""
    from flash_attn import flash_attn_varlen_func

    cu_seqlens, max_seqlen = boundaries.cu_seqlens, boundaries.max_seqlen
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                 softmax_scale=softmax_scale, causal=causal, window_size=window_size(causal, window))
    return out.unsqueeze(0)
