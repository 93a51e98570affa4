"""Segments of a packed row grouped into padded buckets of similar length, for dense attention.

A dense ``[T, T]`` block-diagonal mask costs ``T^2`` however short the documents are. Instead every
segment (the trailing padding segment included) becomes one row of a padded batch: segments are
ranked longest first and grouped into buckets whose members need little padding to reach the
bucket's longest one. Padding sits at the right end of each row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Bucket", "BucketLayout", "build_bucket_layout", "MAX_PAD_FRACTION", "MAX_PAD_TOKENS"]

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


def build_bucket_layout(segment_lengths: tuple[int, ...], device: torch.device) -> BucketLayout:
    """Segments with these lengths, bucketed longest first with bounded padding; built on the host."""
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
            key_padding = torch.from_numpy(real).view(len(members), 1, 1, bucket_length).to(device, non_blocking=True)
        buckets.append(Bucket(len(members), bucket_length, key_padding))
        first_slot += len(members) * bucket_length
    return BucketLayout(torch.from_numpy(slot_of_token).to(device, non_blocking=True), tuple(buckets), first_slot)
