"""What can run on this machine: one record per backend, with the self-check results known for it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import backends_of, registered_ops
from hybrid_pack.ops.selfcheck import kept
from hybrid_pack.ops.selfcheck.result import CheckResult

__all__ = ["BackendStatus", "available"]


@dataclass(frozen=True)
class BackendStatus:
    """One row of :func:`available`: ``usable`` (it can run here and did not fail every check it took), ``reason``
    (why not), and the known self-check results ``checks``."""

    op: str
    backend: str
    usable: bool
    reason: str
    boundary_arg: str
    priority: int
    backward: bool
    checks: tuple[CheckResult, ...] = field(default=())


def _usable_here(backend: Backend) -> str:
    """"" if ``backend`` can run on some device of this machine, else why not."""
    if backend.environment_reason:
        return backend.environment_reason
    here = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    if not any(d in backend.devices for d in here):
        return f"needs a {'/'.join(backend.devices)} device; this machine has {'/'.join(here)}"
    if backend.device_probe is not None:
        reasons = [backend.device_probe(torch.device(d), torch.float32) for d in here if d in backend.devices]
        if all(reasons):
            return reasons[0]
    return ""


def available(op: str | None = None) -> list[BackendStatus]:
    """Every backend of ``op`` (or of every op), whether it can run on this machine, and why not."""
    rows = []
    for name in registered_ops() if op is None else (op,):
        for b in backends_of(name, sharded=None):
            known = not b.environment_reason and kept.results(b.op, b.name)  # else no fingerprint to compute
            checks = tuple(kept.results(b.op, b.name, b.fingerprint)) if known else ()
            failed = [c for c in checks if not c.ok]
            why = _usable_here(b) or (failed[-1].reason if failed and len(failed) == len(checks) else "")
            rows.append(BackendStatus(b.op, b.name, not why, why, b.boundary_arg, b.priority, b.backward, checks))
    return rows
