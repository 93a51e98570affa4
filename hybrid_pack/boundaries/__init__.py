"""Document boundaries of a packed row (:class:`PackedBoundaries`) and the views the ops derive from them."""

from hybrid_pack.boundaries.buckets import Bucket, BucketLayout
from hybrid_pack.boundaries.chunks import ChunkLayout
from hybrid_pack.boundaries.packed import PackedBoundaries

__all__ = ["PackedBoundaries", "ChunkLayout", "BucketLayout", "Bucket"]
