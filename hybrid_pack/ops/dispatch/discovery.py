"""The warm-up's discovery of the call keys a model needs (docs/api.md §5a): inside :func:`discovering` a call whose
key has no settled verdict records it here and runs on the pure-torch backends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from hybrid_pack.ops.selfcheck.contract import Signature

__all__ = ["Wanted", "discovering", "is_discovering", "recording_keys", "record", "take"]

_mode: ContextVar[str] = ContextVar("hybrid_pack_discovering", default="")
_met: dict[Wanted, Any] = {}  # an ordered set; a sharded key maps to its process group
_ran = False


@dataclass(frozen=True)
class Wanted:
    """A call key met while discovering, as the ranks exchange it; ``group_ranks``: a sharded call's group."""

    op: str
    device_type: str
    dtype: str
    requires_grad: bool
    signature: Signature
    group_ranks: tuple[int, ...] = ()


def is_discovering() -> bool:
    """Whether this call runs in the warm-up's own pass of the model (no training call)."""
    return _mode.get() == "replay"


def recording_keys() -> bool:
    """Whether this call runs inside :func:`discovering` (either kind): no check runs, nothing is logged or kept."""
    return bool(_mode.get())


@contextlib.contextmanager
def discovering(*, training_step: bool = False) -> Iterator[None]:
    """Inside the block, calls record their unsettled keys for :func:`hybrid_pack.backends.verify` and run on the
    pure-torch backends. ``training_step``: the block is a real step, of training or evaluation (several forwards
    one batch cannot replay), followed by ``verify()``."""
    global _ran
    token = _mode.set("step" if training_step else "replay")
    try:
        yield
    finally:
        _mode.reset(token)
        _ran = True


def record(wanted: Wanted, group: Any) -> None:
    """Keep a key met while discovering (a sharded one with its process group), once."""
    _met.setdefault(wanted, group)


def take() -> tuple[bool, dict[Wanted, Any]]:
    """Whether a :func:`discovering` block ran since the last warm-up, and the keys met, first met first (both are
    forgotten)."""
    global _ran
    ran, met = _ran, dict(_met)
    _ran = False
    _met.clear()
    return ran, met
