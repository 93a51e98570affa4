"""One verdict per backend and call key for the whole group (docs/api.md §5a, §7b).

A self-check can pass on one rank and fail on another (another GPU, driver or compiler cache); ranks that then
ran different kernels would train on different numerics. Verdicts are therefore settled at one explicit,
collective warm-up, :func:`hybrid_pack.backends.verify`, that every rank calls at the same point (``train``, the
trainers' first step and the CLI do; a custom loop calls it before its first step): every rank checks every key
any rank asked for, and a backend serves a key only where it passed on every rank. Choosing a backend for a call
is then a lookup in this table, never a collective, so ranks that make different calls (the pieces of a
context-parallel row) or code that runs on some ranks only can neither hang nor pair different keys.

Under ``torch.distributed`` a kernel with no settled verdict for a call's key does not serve it (the next
backend does, down to the pure-torch one, logged once); the key is remembered as *wanted*, and the next
``verify()`` checks and settles it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybrid_pack.ops.dispatch.contract import Signature
from hybrid_pack.ops.dispatch.verdicts import CheckResult, VerdictKey

__all__ = ["Wanted", "settled", "settle", "want", "wanted", "group_of", "forget"]

_settled: dict[VerdictKey, CheckResult] = {}
_wanted: dict[Wanted, None] = {}  # an ordered set
_groups: dict[tuple[int, ...], Any] = {}  # the context-parallel groups sharded calls ran on, by their ranks


@dataclass(frozen=True)
class Wanted:
    """A call key a rank asked a verdict for, as the ranks exchange it (no tensors, no device index).

    Attributes:
        op: the op.
        device_type: ``"cuda"`` or ``"cpu"`` (each rank checks on its own device of that type).
        dtype: the dtype the call is chosen for (its first tensor's), by name.
        requires_grad: whether the calls need a backward pass.
        signature: the calls' signature.
        group_ranks: for a call on a sharded row, the context-parallel group's ranks (its backends' check is
            collective over that group); ``()`` for a whole row.
    """

    op: str
    device_type: str
    dtype: str
    requires_grad: bool
    signature: Signature
    group_ranks: tuple[int, ...] = ()


def settled(key: VerdictKey) -> CheckResult | None:
    """The verdict the group settled for ``key``, or None."""
    return _settled.get(key)


def settle(key: VerdictKey, result: CheckResult) -> None:
    """Record the group's verdict for ``key`` (the same on every rank: :func:`hybrid_pack.backends.verify`)."""
    _settled[key] = result


def want(call: Wanted, group: Any = None) -> None:
    """Remember that a call asked for a verdict the group has not settled (``group``: a sharded call's group)."""
    _wanted.setdefault(call, None)
    if call.group_ranks:
        _groups[call.group_ranks] = group


def group_of(ranks: tuple[int, ...]) -> tuple[bool, Any]:
    """``(known, group)``: the process group of ``ranks`` a sharded call of this rank ran on."""
    return ranks in _groups, _groups.get(ranks)


def wanted(*, clear: bool = False) -> list[Wanted]:
    """The keys asked for since the last ``verify()``, in the order first asked (``clear``: forget them)."""
    keys = list(_wanted)
    if clear:
        _wanted.clear()
    return keys


def forget(op: str, backend: str) -> None:
    """Drop the settled verdicts of one backend (it was registered again or removed, on every rank)."""
    for key in [k for k in _settled if k.op == op and k.backend == backend]:
        del _settled[key]
