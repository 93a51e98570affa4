"""The runtime leak guard in a Hugging Face ``Trainer`` (and TRL's trainers, which are ``Trainer``\\ s).

``Trainer(..., callbacks=[PackingGuardCallback()])`` attaches a :class:`~hybrid_pack.testing.PackingGuard`
to the model when training begins: the first packed micro-batch and every ``every``-th after it are
checked against their documents run alone, and a leak stops training with an
:class:`~hybrid_pack.errors.IsolationError` naming the optimizer step and the document. Each log entry
(``trainer.state.log_history``) after a check carries ``guard_checks`` (checks so far),
``guard_max_diff`` (largest difference since the previous log) and ``guard_seconds`` (time spent checking).

TRL's ``SFTTrainer`` replaces the model's forward with a fused LM head that returns per-token
log-probabilities and no logits; the guard then compares the hidden states of the model's backbone
(``model.base_model``), which that forward still runs. An RL trainer's generation with the policy
(``model.generate`` in training mode, without gradient, with a cache) is no training call: the guard neither
checks nor counts it, and checks the packed log-probability calls around it (docs/guard.md).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from hybrid_pack.errors import InputError, MissingExtraError
from hybrid_pack.testing.guard import PackingGuard

try:
    import accelerate  # noqa: F401  (the Trainer needs it; transformers' own message would not name the extra)
    from transformers import TrainerCallback
except ImportError as err:
    raise MissingExtraError("PackingGuardCallback", "hf", err) from err

__all__ = ["PackingGuardCallback"]


class PackingGuardCallback(TrainerCallback):
    """Attach a :class:`~hybrid_pack.testing.PackingGuard` to the trained model for the length of ``train()``.

    Args:
        every, documents, action, atol, localize, seed, group, invariance_every: as for
            :class:`~hybrid_pack.testing.PackingGuard`;
            ``group=None`` in a run of several processes is the world (a ``Trainer`` runs its step on every
            process), so a leak found on one rank stops every rank (docs/api.md §7b).

    Attributes:
        guard: the guard of the current (or last) ``train()`` call; its ``records`` hold every check.
    """

    def __init__(self, *, every: int = 100, documents: int = 3, action: str = "raise", atol: float | None = None,
                 localize: bool = False, seed: int = 0, group: Any = None, invariance_every: int | None = None) -> None:
        self.settings = {"every": every, "documents": documents, "action": action, "atol": atol,
                         "localize": localize, "seed": seed, "invariance_every": invariance_every}
        self.group = group
        PackingGuard(nn.Module(), **self.settings)  # bad settings fail here, not when training starts
        self.guard: PackingGuard | None = None
        self._logged = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise InputError("model: the Trainer passed no model to PackingGuardCallback.on_train_begin")
        if self.guard is not None:
            self.guard.detach()     # a train() that stopped on a leak left its guard attached
        group = self.group if self.group is not None or args.world_size == 1 else dist.group.WORLD
        self.guard = PackingGuard(model, **self.settings, group=group).attach()
        self._logged = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.step = state.global_step

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Add the checks made since the previous log to this log entry (and to callbacks that log after this one)."""
        if self.guard is None or len(self.guard.records) == self._logged:
            return
        new = self.guard.records[self._logged:]
        self._logged = len(self.guard.records)
        figures = {"guard_checks": len(self.guard.records), "guard_max_diff": max(r.max_diff for r in new),
                   "guard_seconds": sum(r.seconds for r in self.guard.records)}
        if logs is not None:
            logs.update(figures)
        if state.log_history:
            state.log_history[-1].update(figures)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.guard is not None:
            self.guard.detach()
