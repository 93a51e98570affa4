"""Parallelism around the packed ops: context parallelism (a row split across ranks, docs/api.md §10)."""

from hybrid_pack.parallel.boundaries import ShardedBoundaries

__all__ = ["ShardedBoundaries"]
