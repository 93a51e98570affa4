"""A leak planted to appear only after some training calls: one mixer starts treating the whole packed
row as a single document, the way a layer that drops its boundaries on the way would."""

from __future__ import annotations

from typing import Any

from torch import nn

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.dispatch.discovery import is_discovering
from hybrid_pack.schema import BOUNDARIES


class LeakAfter:
    """From its ``after``-th training-mode call on (0-based), ``mixer`` ignores the boundaries of the row.

    A native mixer takes its :class:`PackedBoundaries` as a positional argument, a patched Hugging Face
    mixer as the ``boundaries`` keyword: either way it gets one document over the whole row instead.
    Eval-mode calls and the backends' warm-up pass (``backends.verify(model=...)``) are not counted, but leak once
    it leaks.
    """

    def __init__(self, mixer: nn.Module, after: int) -> None:
        self.after, self.training_calls = after, 0
        self._handle = mixer.register_forward_pre_hook(self._before, with_kwargs=True)

    @property
    def leaking(self) -> bool:
        return self.training_calls > self.after

    def _before(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.training_calls += int(module.training and not is_discovering())  # the warm-up's pass is no step
        if not self.leaking:
            return None
        given = [i for i, a in enumerate(args) if isinstance(a, PackedBoundaries)]
        if given:
            whole = PackedBoundaries.from_lengths([args[given[0]].total_tokens], device=args[given[0]].device)
            return tuple(whole if i == given[0] else a for i, a in enumerate(args)), kwargs
        boundaries = kwargs.get(BOUNDARIES)
        if boundaries is not None:
            whole = PackedBoundaries.from_lengths([boundaries.total_tokens], device=boundaries.device)
            return args, {**kwargs, BOUNDARIES: whole}
        return None

    def remove(self) -> None:
        self._handle.remove()
