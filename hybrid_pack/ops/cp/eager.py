"""The compile rule for an op called on a context-parallel shard: the call runs eagerly (a graph break at the op),
so its exchanges and its host-side layout stay out of the graph (docs/compile.md)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._pytree import tree_map

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.ops.compiler import disable

__all__ = ["Op", "eager_on_shards"]

Op = TypeVar("Op", bound=Callable[..., Any])


def eager_on_shards(op: Op) -> Op:
    """``op`` (a public op taking ``boundaries``), run eagerly when a compiled graph calls it on a
    :class:`~hybrid_pack.parallel.ShardedBoundaries`: its exchanges and its host-side layout stay out of the graph,
    and the graph around the call guards only the type of the boundaries (docs/compile.md). Anywhere else the
    call is ``op`` itself.

    The eager call's output tensors get row-major strides: a context-parallel path may return a slice of a longer
    tensor (the halo cut off), whose strides, which the graph after the call guards, would change with the layout.
    """
    @disable
    def eager(*args: Any, **kwargs: Any) -> Any:
        return tree_map(_row_major, op(*args, **kwargs))

    @functools.wraps(op)
    def call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() and any(isinstance(value, ShardedBoundaries)
                                                 for value in (*args, *kwargs.values())):
            return eager(*args, **kwargs)
        return op(*args, **kwargs)

    return call  # type: ignore[return-value]


def _row_major(value: Any) -> Any:
    """``value``, a tensor copied to row-major strides when it has others (a size-1 dim's stride included)."""
    if not isinstance(value, torch.Tensor):
        return value
    expected, stride = [], 1
    for size in reversed(value.shape):
        expected.append(stride)
        stride *= size
    if tuple(reversed(expected)) == value.stride():
        return value
    return value.clone(memory_format=torch.contiguous_format)
