"""The pure-torch attention backend: one dense block per document, documents batched by length.

A dense ``[T, T]`` block-diagonal mask costs ``T^2`` memory and compute however short the
documents are. Instead every segment (the trailing padding segment included) becomes one row of
a padded batch (:meth:`PackedBoundaries.bucket_layout`: segments ranked longest first, grouped
into buckets whose members need little padding), and each bucket ``[B, H, L, D]`` runs
:func:`torch.nn.functional.scaled_dot_product_attention` (memory-efficient on CPU and GPU).

Padding sits at the right end of each row. Causal queries never see it (it comes after them); non-causal
queries get an explicit key-padding mask. A sliding window is a band mask ``[L, L]`` (``0 <= i - j < window``)
shared by every row of a bucket: each row starts at its document's first token. Padded slots hold zeros, their
outputs are dropped, and no gradient reaches them, so the result equals each document attended alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.buckets import BucketLayout


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                     causal: bool, softmax_scale: float, window: int | None = None,
                     buckets: BucketLayout | None = None) -> torch.Tensor:
    """Attention where each token sees only tokens of its own segment.

    Args:
        q: ``[1, T, H, D]``.
        k, v: ``[1, T, Hkv, D]``; query head ``h`` uses key/value head ``h // (H // Hkv)``.
        boundaries: where the documents of the row start.
        causal: mask future tokens.
        softmax_scale: multiplies ``q @ k^T`` before the softmax.
        window: causal only: query ``i`` sees keys ``j`` with ``0 <= i - j < window`` (None: every earlier key).
        buckets: the padded batch the segments run in (None: :meth:`PackedBoundaries.bucket_layout`;
            :func:`hybrid_pack.batch_invariant` passes its canonical one).

    Returns:
        ``[1, T, H, D]`` in the dtype of ``q``.
    """
    layout = boundaries.bucket_layout() if buckets is None else buckets
    num_heads, num_kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    if q.device.type == "cuda" and num_heads != num_kv_heads:
        # On CUDA, SDPA's enable_gqa runs only in the flash and math kernels; repeating the kv heads keeps
        # the memory-efficient kernel (linear memory) available for fp32 and masked calls.
        k, v = (t.repeat_interleave(num_heads // num_kv_heads, dim=2) for t in (k, v))
        num_kv_heads = num_heads
    sizes = [bucket.num_slots for bucket in layout.buckets]
    q_rows, k_rows, v_rows = (layout.to_slots(t[0]).split(sizes) for t in (q, k, v))
    outputs = []
    for bucket, *qkv in zip(layout.buckets, q_rows, k_rows, v_rows):
        mask = band_mask(bucket.length, window, q.device) if window is not None else (
            None if causal else bucket.key_padding)
        out = F.scaled_dot_product_attention(
            *(x.view(bucket.num_rows, bucket.length, -1, head_dim).transpose(1, 2) for x in qkv),
            attn_mask=mask, is_causal=causal and window is None, scale=softmax_scale,
            enable_gqa=num_heads != num_kv_heads)
        outputs.append(out.transpose(1, 2).reshape(bucket.num_slots, num_heads, head_dim))
    return layout.from_slots(torch.cat(outputs)).unsqueeze(0)


def band_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """bool ``[length, length]``: True where query ``i`` sees key ``j`` (``0 <= i - j < window``)."""
    position = torch.arange(length, device=device)
    distance = position[:, None] - position[None, :]
    return (distance >= 0) & (distance < window)
