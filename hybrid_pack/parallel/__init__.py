"""Parallelism around the packed ops: context parallelism (a row split across ranks, docs/api.md §10) and
FSDP2 sharding of a model (``fsdp.py``).

``shard_batch`` and the mesh helpers load on first use (they import the loss, which imports
:class:`ShardedBoundaries` from here).
"""

from __future__ import annotations

import importlib
from typing import Any

from hybrid_pack.parallel.boundaries import ShardedBoundaries

_LAZY = {
    "shard_batch": "hybrid_pack.parallel.shard",
    "context_parallel_mesh": "hybrid_pack.parallel.mesh",
}

__all__ = ["ShardedBoundaries", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybrid_pack.parallel' has no attribute {name!r}")
