"""The Mamba-1 selective scan: the public op, its pure-torch backend (chunked, memory ``O(T·D)``), its static
form for :class:`~hybrid_pack.boundaries.StaticBoundaries` and its state passing on a context-parallel shard."""

from hybrid_pack.ops.selective_scan import backends as _backends  # noqa: F401  (registers the backends)
from hybrid_pack.ops.selective_scan.op import selective_scan

__all__ = ["selective_scan"]
