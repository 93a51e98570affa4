"""Parallelism around the packed ops: context parallelism (a row split across ranks, docs/api.md §10) and
FSDP2 sharding of a model (``fsdp.py``)."""

from hybrid_pack.parallel.boundaries import ShardedBoundaries

__all__ = ["ShardedBoundaries"]
