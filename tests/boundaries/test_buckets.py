"""The bucket layout the torch attention backend derives from the boundaries: every token has its own
slot, buckets are few, and padding stays bounded."""

from __future__ import annotations

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.buckets import MAX_PAD_FRACTION, MAX_PAD_TOKENS


def test_buckets_bound_padding_and_cover_every_token() -> None:
    lengths = [3000, 2900, 1, 1, 2, 700, 650, 17, 4, 1200, 9]
    boundaries = PackedBoundaries.from_lengths(lengths)
    layout = boundaries.bucket_layout()
    assert layout is boundaries.bucket_layout()
    slots = layout.slot_of_token.tolist()
    assert len(set(slots)) == len(slots) and max(slots) < layout.num_slots
    assert sum(bucket.num_slots for bucket in layout.buckets) == layout.num_slots
    assert [bucket.length for bucket in layout.buckets] == sorted({b.length for b in layout.buckets}, reverse=True)
    allowed_padding = sum(max(MAX_PAD_FRACTION * length / (1 - MAX_PAD_FRACTION), MAX_PAD_TOKENS) for length in lengths)
    assert layout.num_slots - boundaries.total_tokens <= allowed_padding
    assert len(layout.buckets) < len(lengths)
