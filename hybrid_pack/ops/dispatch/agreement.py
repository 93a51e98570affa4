"""One backend per op on every rank (docs/api.md §5a, §7b): self-check verdicts agreed across the ranks.

A self-check can pass on one rank and fail on another (another GPU, driver or compiler cache). Ranks that
then ran different kernels would train on different numerics, and a sharded model's ranks would no longer
compute the same function. So once a process group is initialised, the first time a process asks for a
verdict (a new op, backend, device, dtype, gradient and signature key) every rank gathers every rank's
outcome, and a backend serves the key only where it passed on every rank; later calls read the agreed
verdict with no collective.

Ranks establish keys in the same order because they run the same model: a key is made of the op and the
non-token sizes of its call, never of the tokens a rank's row holds. Code that runs on some ranks only
(rank-0 evaluation, say), ranks that run different layers (pipeline stages) and the ranks of a
context-parallel row (whose local calls differ: the ops' ``cp.py`` paths) must not agree over the world: they
run inside :func:`rank_local`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from contextvars import ContextVar

from hybrid_pack.distributed import distributed, gather_rows, share_objects
from hybrid_pack.ops.dispatch.verdicts import CheckResult, VerdictKey

__all__ = ["agree", "agreed", "forget", "rank_local"]

_agreed: dict[VerdictKey, CheckResult] = {}
_rank_local: ContextVar[bool] = ContextVar("hybrid_pack_rank_local_verdicts", default=False)


@contextlib.contextmanager
def rank_local() -> Iterator[None]:
    """Inside the block, verdicts not yet agreed are this rank's own (for code that runs on some ranks only)."""
    token = _rank_local.set(True)
    try:
        yield
    finally:
        _rank_local.reset(token)


def agreed(key: VerdictKey) -> CheckResult | None:
    """The verdict every rank agreed on for ``key``, or None (not agreed yet, or a single process)."""
    return _agreed.get(key)


def agree(key: VerdictKey, result: CheckResult) -> CheckResult:
    """``result`` (this rank's verdict for ``key``) as every rank agrees on it: failed where any rank failed.

    A collective over the world the first time ``key`` is agreed; a single process (or :func:`rank_local`) gets
    ``result`` back as it is.
    """
    known = _agreed.get(key)
    if known is not None:
        return known
    if not distributed() or _rank_local.get():
        return result
    passed = [bool(row[0]) for row in gather_rows([float(result.ok)])]
    if not all(passed):
        reasons = share_objects(result.reason)
        failed = [rank for rank, ok in enumerate(passed) if not ok]
        if result.ok:
            result = dataclasses.replace(result, ok=False, reason=(
                f"passed its self-check here but failed it on rank {failed[0]} ({reasons[failed[0]]}); "
                "every rank runs the same backend"))
    _agreed[key] = result
    return result


def forget(op: str, backend: str) -> None:
    """Drop the agreed verdicts of one backend (it was registered again or removed, on every rank)."""
    for key in [k for k in _agreed if k.op == op and k.backend == backend]:
        del _agreed[key]
