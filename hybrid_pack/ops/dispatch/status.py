"""What the backends can do here: :func:`available` (what is known of each, and why not)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybrid_pack.ops.dispatch import verdicts
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import backends_of, registered_ops
from hybrid_pack.ops.dispatch.verdicts import CheckResult

__all__ = ["BackendStatus", "available", "checks_of", "default_device", "default_dtypes"]


@dataclass(frozen=True)
class BackendStatus:
    """One row of :func:`available`.

    Attributes:
        op, backend: which backend.
        usable: it can run on this machine and has not failed every self-check it took.
        reason: why not ("" when usable): what is missing, or the self-check it failed.
        boundary_arg: how the kernel is told where documents start.
        priority: higher is tried first.
        backward: whether it has a backward pass.
        checks: the self-check results known for it here (this process and the on-disk cache).
    """

    op: str
    backend: str
    usable: bool
    reason: str
    boundary_arg: str
    priority: int
    backward: bool
    checks: tuple[CheckResult, ...] = field(default=())


def checks_of(backend: Backend) -> list[CheckResult]:
    """The self-check results known for ``backend``'s current code (none for a backend that cannot run here)."""
    if backend.environment_reason or not verdicts.results(backend.op, backend.name):
        return []
    return verdicts.results(backend.op, backend.name, backend.fingerprint)


def available(op: str | None = None) -> list[BackendStatus]:
    """Every backend of ``op`` (or of every op), whether it can run on this machine, and why not."""
    rows = []
    for name in registered_ops() if op is None else (op,):
        for b in backends_of(name, sharded=None):
            checks = tuple(checks_of(b))
            failed = [c for c in checks if not c.ok]
            why = b.usable_here or (failed[-1].reason if failed and len(failed) == len(checks) else "")
            rows.append(BackendStatus(b.op, b.name, not why, why, b.boundary_arg, b.priority, b.backward, checks))
    return rows


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtypes(device: torch.device) -> tuple[torch.dtype, ...]:
    """The dtypes :func:`verify` checks when none is given: training's on that device."""
    return (torch.bfloat16, torch.float32) if device.type == "cuda" else (torch.float32,)
