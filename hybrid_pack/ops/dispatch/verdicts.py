"""The verdicts in force in this process (docs/api.md §5a): :data:`SETTLED` by the warm-up (the group's, under
``torch.distributed``) or by a single eager process's first call of a key, and the routes' answers :data:`CHOICES`."""

from __future__ import annotations

from typing import Any

from hybrid_pack.ops.selfcheck import kept
from hybrid_pack.ops.selfcheck.kept import VerdictKey, lookup
from hybrid_pack.ops.selfcheck.result import CheckResult

__all__ = ["SETTLED", "CHOICES", "generation", "changed", "forced", "settle", "forget"]

SETTLED: dict[VerdictKey, CheckResult] = {}
"""The verdicts calls read: the same on every rank once the warm-up settled them."""
CHOICES: dict[tuple[Any, ...], Any] = {}
"""The ops' routes' answers per call key, the forcing part of it (cleared whenever a verdict or a registration
changes)."""
generation = 0
"""One number per state of the choices (the verdicts and registrations as changed so far, and the forcing in
force): a compiled graph reads it, so it is traced again in a new state and used again when a state returns."""
_changes = 0
_forcing: frozenset[tuple[str, str]] = frozenset()
_states: dict[tuple[int, frozenset[tuple[str, str]]], int] = {}


def _restate() -> None:
    global generation
    generation = _states.setdefault((_changes, _forcing), len(_states))


def changed() -> None:
    """Forget every route's answers and re-trace compiled graphs (a verdict or a registration changed)."""
    global _changes
    CHOICES.clear()
    _changes += 1
    _restate()


def forced(forcing: frozenset[tuple[str, str]]) -> None:
    """The backends ``use_backends`` forces from now on (route answers are keyed by the forcing already)."""
    global _forcing
    _forcing = forcing
    _restate()


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
