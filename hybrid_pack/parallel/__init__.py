"""Parallelism around the packed ops: context parallelism (a row split across ranks, docs/api.md §10), and the
scale-out features applied to a model by one entry, :func:`parallelize` (activation checkpointing, per-block
compile, FSDP2 over the flattened ``("dp", "cp")`` mesh)."""

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.parallel.activation_checkpointing import apply_activation_checkpointing
from hybrid_pack.parallel.mesh import context_parallel_mesh, flattened
from hybrid_pack.parallel.parallelize import parallelize
from hybrid_pack.parallel.shard import shard_batch

__all__ = ["ShardedBoundaries", "apply_activation_checkpointing", "context_parallel_mesh", "flattened",
           "parallelize", "shard_batch"]
