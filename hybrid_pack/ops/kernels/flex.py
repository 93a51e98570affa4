"""torch flex attention adapter: a document mask built from ``seq_idx``.

``mask_mod(q, kv) = seq_idx[q] == seq_idx[kv]`` (and ``q >= kv`` when causal) is compiled into a
block-sparse :class:`~torch.nn.attention.flex_attention.BlockMask` once per segment layout and
cached, so blocks that straddle no document are skipped and the per-call cost is the kernel
alone. On CUDA the kernel is ``torch.compile(flex_attention)``; elsewhere flex attention runs
eagerly (it materialises the scores: a check, not a fast path).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, lru_cache

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["varlen_attention", "document_block_mask"]


@lru_cache(maxsize=32)
def _document_block_mask(segment_lengths: tuple[int, ...], causal: bool, device: torch.device) -> BlockMask:
    lengths = torch.tensor(segment_lengths, dtype=torch.int64)
    seq_idx = torch.repeat_interleave(torch.arange(len(segment_lengths), dtype=torch.int32), lengths).to(device)

    def same_document(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        keep = seq_idx[q_idx] == seq_idx[kv_idx]
        return keep & (q_idx >= kv_idx) if causal else keep

    total = int(lengths.sum())
    return create_block_mask(same_document, B=None, H=None, Q_LEN=total, KV_LEN=total, device=device)


def document_block_mask(boundaries: PackedBoundaries, causal: bool) -> BlockMask:
    """The cached block mask that keeps every token inside its own segment of ``boundaries``."""
    return _document_block_mask(boundaries.segment_lengths, causal, boundaries.device)


@cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    return torch.compile(flex_attention)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                     causal: bool, softmax_scale: float) -> torch.Tensor:
    """:func:`hybrid_pack.ops.varlen_attention` through ``flex_attention(block_mask=document mask)``."""
    attend = _compiled_flex_attention() if q.device.type == "cuda" else flex_attention
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                 block_mask=document_block_mask(boundaries, causal), scale=softmax_scale,
                 enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)
