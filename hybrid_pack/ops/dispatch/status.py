"""What the backends can do here: :func:`available` (what is known) and :func:`verify` (check now)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from hybrid_pack.ops.dispatch import verdicts
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import backends_of, contract_of, registered_ops
from hybrid_pack.ops.dispatch.selector import check_now
from hybrid_pack.ops.dispatch.verdicts import CheckResult

__all__ = ["BackendStatus", "available", "verify", "checks_of", "default_device", "default_dtypes"]


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
        for b in backends_of(name):
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


def verify(op: str | None = None, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           requires_grad: bool = True, progress: bool | None = None) -> list[CheckResult]:
    """Run the self-check now for every backend of ``op`` (or of every op) that can run on ``device``.

    Each backend is checked with the op's typical signature for each dtype (``dtype``, or bfloat16 and
    float32 on CUDA, float32 on CPU); a result replaces any kept one. The pure-torch backends are checked
    too (packed against alone and the cross-document gradient; their reference is themselves in float64).
    ``progress``: a progress bar on stderr, one step per check (default: when stderr is a terminal).

    Returns:
        One :class:`CheckResult` per backend and dtype (``op``, ``backend``, ``ok``, ``reason``,
        ``max_error``, ``seconds``).
    """
    device = default_device() if device is None else torch.device(device)
    dtypes = (dtype,) if dtype is not None else default_dtypes(device)
    checks = [(backend, dt) for name in (registered_ops() if op is None else (op,)) for backend in backends_of(name)
              for dt in dtypes if not backend.reason(device, dt, requires_grad)]
    out = []
    with tqdm(checks, desc="self-checks", unit="check", leave=False,
              disable=None if progress is None else not progress) as bar:
        for backend, dt in bar:
            bar.set_postfix_str(f"{backend.op} {backend.name} {str(dt).removeprefix('torch.')}")
            signature = contract_of(backend.op).default_signature(dt, device.type)
            out.append(check_now(backend, signature, device, requires_grad))
    return out
