"""Softmax attention on :class:`StaticBoundaries`: a segment mask built from ``seq_idx`` inside the graph.

The pure-torch backend batches segments by length, and those buckets are data-dependent shapes. Here every
query instead meets the keys of the row under a boolean mask, ``seq_idx[i] == seq_idx[j]`` (and ``j <= i``
when causal), built from ``seq_idx`` as a tensor, so one graph serves every layout of the same ``(T, S)``
and AOTAutograd derives the backward of
:func:`torch.nn.functional.scaled_dot_product_attention` (flash attention on CPU, which recomputes the
scores blockwise instead of saving them).

SDPA computes every score a mask hides; it skips none. So a causal row is cut into query blocks of
:data:`QUERY_BLOCK` tokens and block ``b`` attends only the keys up to its own end: about half the scores
(and mask) of one dense ``[T, T]`` call. With a sliding window a block meets only the keys from
``window - 1`` before its start to its end. The work stays quadratic in ``T`` whatever the documents' lengths:
a static graph must serve a row holding one document of ``T`` tokens.

Every token sees itself (causal) or its whole segment, so no softmax row is empty; the padding segment is a
segment like any other and zero-length slots own no token.

Flex attention with a block mask built from ``seq_idx`` in the graph would skip the hidden blocks, but on
CPU it has no backward (torch 2.13 raises on inputs that require grad) and its inductor kernel takes no
float64; this form serves training and float64 alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries.static import StaticBoundaries

__all__ = ["varlen_attention", "QUERY_BLOCK"]

QUERY_BLOCK = 256  # causal query block: fastest of 256, 512, 1024 compiled on CPU at T = 1024 and 4096


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: StaticBoundaries, *,
                     causal: bool, softmax_scale: float, window: int | None = None) -> torch.Tensor:
    """Attention where each token sees only tokens of its own segment, read from tensors only.

    Args:
        q: ``[1, T, H, D]``.
        k, v: ``[1, T, Hkv, D]``; query head ``h`` uses key/value head ``h // (H // Hkv)``.
        boundaries: the row's static boundaries (only ``seq_idx`` is read, as a tensor).
        causal: mask future tokens.
        softmax_scale: multiplies ``q @ k^T`` before the softmax.
        window: causal only: query ``i`` sees keys ``j`` with ``0 <= i - j < window`` (None: every earlier key).

    Returns:
        ``[1, T, H, D]`` in the dtype of ``q``.
    """
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    if q.device.type == "cuda" and num_heads != num_kv_heads:
        # SDPA's enable_gqa runs only in CUDA's flash and math kernels, and flash takes no mask: repeating the
        # key/value heads keeps the memory-efficient kernel.
        k, v = (t.repeat_interleave(num_heads // num_kv_heads, dim=2) for t in (k, v))
        num_kv_heads = num_heads
    segment = boundaries.seq_idx[0]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                           # [1, heads, T, D]
    if not causal:
        same_segment = segment[:, None] == segment[None, :]                    # [T, T]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=same_segment, scale=softmax_scale,
                                             enable_gqa=num_heads != num_kv_heads)
        return out.transpose(1, 2)
    num_tokens = q.shape[2]
    token = torch.arange(num_tokens, device=q.device)
    blocks = []
    for start in range(0, num_tokens, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, num_tokens)
        first = 0 if window is None else max(0, start - window + 1)
        distance = token[start:end, None] - token[None, first:end]                  # [block, end - first]
        visible = (segment[start:end, None] == segment[None, first:end]) & (distance >= 0)
        if window is not None:
            visible &= distance < window
        blocks.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, first:end], v[:, :, first:end],
                                                     attn_mask=visible, scale=softmax_scale,
                                                     enable_gqa=num_heads != num_kv_heads))
    return torch.cat(blocks, dim=2).transpose(1, 2)
