"""The boundaries of the packed row a patched model is running on, visible to its patched layers.

The entry that receives a packed batch (:mod:`.entry`: the model, its backbone or a decoder layer)
sets them for the duration of that call; patched attention functions and mixers read them. Outside
such a call (ordinary batches) they are None and every patched layer runs its original code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextvars import ContextVar, Token
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["current_boundaries", "packed_row", "carry_boundaries"]

_BOUNDARIES: ContextVar[PackedBoundaries | None] = ContextVar("hybrid_pack_boundaries", default=None)


@torch.compiler.disable
def current_boundaries() -> PackedBoundaries | None:
    """The boundaries of the packed row being run, or None outside a packed call."""
    return _BOUNDARIES.get()


class packed_row(contextlib.AbstractContextManager):
    """Make ``boundaries`` current inside the block (None: an ordinary, unpacked call).

    ``torch.compile`` never traces entering or leaving it: the boundaries are Python-level state.
    """

    def __init__(self, boundaries: PackedBoundaries | None) -> None:
        self.boundaries = boundaries
        self._token: Token[PackedBoundaries | None] | None = None

    @torch.compiler.disable
    def __enter__(self) -> None:
        self._token = _BOUNDARIES.set(self.boundaries)

    @torch.compiler.disable
    def __exit__(self, *exc_info: object) -> None:
        _BOUNDARIES.reset(self._token)


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
