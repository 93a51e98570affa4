"""Parallelism around the packed ops: context parallelism (a row split across ranks, docs/api.md §10) and
FSDP2 sharding of a model (``fsdp.py``)."""

from hybrid_pack.parallel.boundaries import ShardedBoundaries
from hybrid_pack.parallel.mesh import context_parallel_mesh
from hybrid_pack.parallel.shard import shard_batch

__all__ = ["ShardedBoundaries", "shard_batch", "context_parallel_mesh"]
