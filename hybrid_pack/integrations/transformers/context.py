"""The boundaries of the packed row a patched model is running on, visible to its patched layers.

:func:`~hybrid_pack.integrations.transformers.patch_model` sets them for the duration of one forward
call; patched attention functions and mixers read them. Outside such a call (ordinary batches) they
are None and every patched layer runs its original code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["current_boundaries", "packed_row", "carry_boundaries"]

_BOUNDARIES: ContextVar[PackedBoundaries | None] = ContextVar("hybrid_pack_boundaries", default=None)


def current_boundaries() -> PackedBoundaries | None:
    """The boundaries of the packed row being run, or None outside a packed call."""
    return _BOUNDARIES.get()


@contextlib.contextmanager
def packed_row(boundaries: PackedBoundaries | None) -> Iterator[None]:
    """Make ``boundaries`` current inside the block (None: an ordinary, unpacked call)."""
    token = _BOUNDARIES.set(boundaries)
    try:
        yield
    finally:
        _BOUNDARIES.reset(token)


def carry_boundaries(checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a layer's gradient-checkpointing function so its backward recompute sees the same boundaries.

    The recompute runs during ``backward()``, after the forward call (and its context) has ended; the
    wrapped function captures the boundaries current at forward time and restores them around every run.
    """
    if getattr(checkpoint, "_hybrid_pack_carries_boundaries", False):
        return checkpoint

    def checkpoint_with_boundaries(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        boundaries = current_boundaries()

        def run(*inner: Any, **inner_kwargs: Any) -> Any:
            with packed_row(boundaries):
                return function(*inner, **inner_kwargs)

        return checkpoint(run, *args, **kwargs)

    checkpoint_with_boundaries._hybrid_pack_carries_boundaries = True  # type: ignore[attr-defined]
    return checkpoint_with_boundaries
