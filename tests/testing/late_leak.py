"""A leak planted to appear only after some training calls: one mixer starts treating the whole packed
row as a single document, the way a layer that drops its boundaries on the way would."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers.context import current_boundaries, packed_row


class LeakAfter:
    """From its ``after``-th training-mode call on (0-based), ``mixer`` ignores the boundaries of the row.

    A native mixer takes its :class:`PackedBoundaries` as an argument: it gets one document over the
    whole row instead. A mixer of a patched Hugging Face model reads them from the packed-row context:
    that context is replaced around its call. Eval-mode calls are not counted, but leak once it leaks.
    """

    def __init__(self, mixer: nn.Module, after: int) -> None:
        self.after, self.training_calls = after, 0
        self._stack = contextlib.ExitStack()
        self._handles = [mixer.register_forward_pre_hook(self._before), mixer.register_forward_hook(self._after)]

    @property
    def leaking(self) -> bool:
        return self.training_calls > self.after

    def _before(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        self.training_calls += int(module.training)
        if not self.leaking:
            return None
        given = [i for i, a in enumerate(args) if isinstance(a, PackedBoundaries)]
        if given:
            whole = PackedBoundaries.from_lengths([args[given[0]].total_tokens], device=args[given[0]].device)
            return tuple(whole if i == given[0] else a for i, a in enumerate(args))
        boundaries = current_boundaries()
        if boundaries is not None:
            whole = PackedBoundaries.from_lengths([boundaries.total_tokens], device=boundaries.device)
            self._stack.enter_context(packed_row(whole))
        return None

    def _after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._stack.close()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
