"""Softmax attention on a packed row, one dense block per document, documents batched by length.

A dense ``[T, T]`` block-diagonal mask costs ``T^2`` memory and compute however short the
documents are. Instead every segment (the trailing padding segment included) becomes one row of
a padded batch: segments are ranked longest first and grouped into buckets whose members need
little padding to reach the bucket's longest one, and each bucket ``[B, H, L, D]`` runs
:func:`torch.nn.functional.scaled_dot_product_attention` (memory-efficient on CPU and GPU).

Padding sits at the right end of each row. Causal queries never see it (it comes after them);
non-causal queries get an explicit key-padding mask. Padded slots hold zeros, their outputs are
dropped, and no gradient reaches them, so the result equals each document attended alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries

# A segment joins the current bucket when padding it to the bucket's length adds at most this
# fraction of that length, or at most this many tokens (so many tiny documents share one bucket).
MAX_PAD_FRACTION = 0.125
MAX_PAD_TOKENS = 16


@dataclass(frozen=True, eq=False)
class Bucket:
    """``num_rows`` segments, each right-padded to ``length`` tokens.

    Attributes:
        key_padding: bool ``[num_rows, 1, 1, length]``, True on real keys; None when no row is padded.
    """

    num_rows: int
    length: int
    key_padding: torch.Tensor | None

    @property
    def num_slots(self) -> int:
        return self.num_rows * self.length


@dataclass(frozen=True, eq=False)
class BucketLayout:
    """Where each packed token sits in the padded, bucketed batch.

    Attributes:
        slot_of_token: int64 ``[T]``, flat slot of each packed token.
        buckets: the buckets, longest first, their slots one after another.
        num_slots: total slots, padding included.
    """

    slot_of_token: torch.Tensor
    buckets: tuple[Bucket, ...]
    num_slots: int

    def to_slots(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` -> ``[num_slots, ...]``, zeros in padded slots."""
        return x.new_zeros(self.num_slots, *x.shape[1:]).index_copy(0, self.slot_of_token, x)

    def from_slots(self, y: torch.Tensor) -> torch.Tensor:
        """``[num_slots, ...]`` -> ``[T, ...]`` (padded slots dropped)."""
        return y.index_select(0, self.slot_of_token)


def _group_by_length(lengths: np.ndarray) -> list[list[int]]:
    """Segment ids, longest first, cut into buckets whose members need little padding."""
    groups: list[list[int]] = []
    bucket_length = 0
    for segment in np.argsort(-lengths, kind="stable").tolist():
        slack = bucket_length - int(lengths[segment])
        if groups and (slack <= MAX_PAD_FRACTION * bucket_length or slack <= MAX_PAD_TOKENS):
            groups[-1].append(segment)
        else:
            groups.append([segment])
            bucket_length = int(lengths[segment])
    return groups


@lru_cache(maxsize=64)
def _build(segment_lengths: tuple[int, ...], device: torch.device) -> BucketLayout:
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    slot_of_token = np.empty(int(lengths.sum()), dtype=np.int64)
    buckets = []
    first_slot = 0
    for members in _group_by_length(lengths):
        bucket_length = int(lengths[members[0]])
        member_lengths = lengths[members]
        for row, segment in enumerate(members):
            start, length = int(starts[segment]), int(lengths[segment])
            row_slot = first_slot + row * bucket_length
            slot_of_token[start:start + length] = np.arange(row_slot, row_slot + length)
        key_padding = None
        if (member_lengths < bucket_length).any():
            real = np.arange(bucket_length)[None, :] < member_lengths[:, None]
            key_padding = torch.from_numpy(real).view(len(members), 1, 1, bucket_length).to(device)
        buckets.append(Bucket(len(members), bucket_length, key_padding))
        first_slot += len(members) * bucket_length
    return BucketLayout(torch.from_numpy(slot_of_token).to(device), tuple(buckets), first_slot)


def bucket_layout(boundaries: PackedBoundaries) -> BucketLayout:
    """The (cached) bucketed layout of ``boundaries``' segments; built on the host."""
    return _build(boundaries.segment_lengths, boundaries.device)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                     causal: bool, softmax_scale: float) -> torch.Tensor:
    """Attention where each token sees only tokens of its own segment.

    Args:
        q: ``[1, T, H, D]``.
        k, v: ``[1, T, Hkv, D]``; query head ``h`` uses key/value head ``h // (H // Hkv)``.
        boundaries: where the documents of the row start.
        causal: mask future tokens.
        softmax_scale: multiplies ``q @ k^T`` before the softmax.

    Returns:
        ``[1, T, H, D]`` in the dtype of ``q``.
    """
    layout = bucket_layout(boundaries)
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
        out = F.scaled_dot_product_attention(
            *(x.view(bucket.num_rows, bucket.length, -1, head_dim).transpose(1, 2) for x in qkv),
            attn_mask=None if causal else bucket.key_padding, is_causal=causal, scale=softmax_scale,
            enable_gqa=num_heads != num_kv_heads)
        outputs.append(out.transpose(1, 2).reshape(bucket.num_slots, num_heads, head_dim))
    return layout.from_slots(torch.cat(outputs)).unsqueeze(0)
