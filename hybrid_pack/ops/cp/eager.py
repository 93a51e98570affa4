"""The compile rule for an op called on a context-parallel shard: the call runs eagerly (a graph break at the op),
so its exchanges and its host-side layout stay out of the graph (docs/compile.md). The ops' routes apply it
(:class:`~hybrid_pack.ops.dispatch.route.OpRoute`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from hybrid_pack.ops.compiler import disable

__all__ = ["run_eagerly"]


@disable
def run_eagerly(route: Callable[..., Any], arguments: dict[str, Any], boundaries: Any, backend: str | None,
                requires_grad: bool) -> Any:
    """``route(arguments, boundaries, ...)`` run outside the graph that calls it, its output tensors with row-major
    strides: a context-parallel path may return a slice of a longer tensor (the halo cut off), whose strides, which
    the graph after the call guards, would change with the layout."""
    return tree_map(_row_major, route(arguments, boundaries, backend=backend, requires_grad=requires_grad))


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
