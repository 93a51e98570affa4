"""The verdicts in force in this process (docs/api.md §5a): :data:`SETTLED` by the warm-up (the group's, under
``torch.distributed``) or by a single eager process's first call of a key, and the routes' answers :data:`CHOICES`."""

from __future__ import annotations

from typing import Any

from hybrid_pack.ops.selfcheck import kept
from hybrid_pack.ops.selfcheck.kept import VerdictKey, lookup
from hybrid_pack.ops.selfcheck.result import CheckResult

__all__ = ["SETTLED", "CHOICES", "generation", "changed", "settle", "forget"]

SETTLED: dict[VerdictKey, CheckResult] = {}
"""The verdicts calls read: the same on every rank once the warm-up settled them."""
CHOICES: dict[tuple[Any, ...], Any] = {}
"""The ops' routes' answers per call key (cleared whenever a verdict, a registration or a forcing changes)."""
generation = 0
"""Counts the changes to :data:`CHOICES`: a compiled graph reads it, so it is traced again after a change."""


def changed() -> None:
    """Forget every route's answers and re-trace compiled graphs (a verdict, a registration or a forcing changed)."""
    global generation
    CHOICES.clear()
    generation += 1


def settle(key: VerdictKey, result: CheckResult) -> None:
    """Put ``result`` in force for ``key`` (the warm-up: the same on every rank); compiled graphs are traced again
    unless the verdict a call of ``key`` reads stays what it was."""
    before = lookup(SETTLED.get, key)
    SETTLED[key] = result
    if before is None or (before.ok, before.reason) != (result.ok, result.reason):
        changed()


def forget(op: str, backend: str) -> None:
    """Drop this process's results for one backend, kept and settled (it was registered again or removed)."""
    kept.forget(op, backend)
    for key in [k for k in SETTLED if k.op == op and k.backend == backend]:
        del SETTLED[key]
    changed()
