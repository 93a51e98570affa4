"""Document boundaries of a packed row (:class:`PackedBoundaries`; :class:`StaticBoundaries` inside a compiled
graph) and the views the ops derive from them."""

from hybrid_pack.boundaries.buckets import Bucket, BucketLayout
from hybrid_pack.boundaries.chunks import ChunkLayout
from hybrid_pack.boundaries.packed import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries

__all__ = ["PackedBoundaries", "StaticBoundaries", "ChunkLayout", "BucketLayout", "Bucket"]
