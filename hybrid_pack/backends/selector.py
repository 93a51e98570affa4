"""Choosing the backend that runs an op: priority order, forcing, and the environment override.

Only boundary-aware backends are ever registered, so every choice keeps documents apart. A
backend forced by argument, :func:`use_backends` or ``HYBRID_PACK_BACKENDS`` that cannot run
raises :class:`RuntimeError` with the reason; an automatic choice skips backends that cannot
take the inputs and logs the skip once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.backends.registry import OPS, Backend, backends_of, get_backend

__all__ = ["BackendStatus", "available", "select", "resolve", "use_backends", "report", "ENV_VAR"]

ENV_VAR = "HYBRID_PACK_BACKENDS"

logger = logging.getLogger("hybrid_pack.backends")
_logged: set[tuple[str, str, str]] = set()
_forced: ContextVar[Mapping[str, str]] = ContextVar("hybrid_pack_forced_backends", default={})


@dataclass(frozen=True)
class BackendStatus:
    """One row of :func:`available`: whether ``backend`` of ``op`` can run on this machine."""

    op: str
    backend: str
    usable: bool
    reason: str
    boundary_arg: str
    priority: int
    backward: bool


def _check_forced(mapping: Mapping[str, str], source: str) -> dict[str, str]:
    for op, name in mapping.items():
        if op not in OPS:
            raise ValueError(f"{source}: unknown op {op!r}; ops are {list(OPS)}")
        try:
            get_backend(op, name)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
    return dict(mapping)


def _env_forced() -> dict[str, str]:
    return _parse_env(os.environ.get(ENV_VAR, "").strip())


@functools.lru_cache(maxsize=8)
def _parse_env(raw: str) -> dict[str, str]:
    if not raw:
        return {}
    pairs = {}
    for item in filter(None, (p.strip() for p in raw.split(","))):
        op, sep, name = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{ENV_VAR}: expected comma-separated op=backend pairs such as "
                             f"'conv=torch,ssd=mamba_ssm'; got {raw!r}")
        pairs[op.strip()] = name.strip()
    return _check_forced(pairs, ENV_VAR)


def _forced_for(op: str) -> tuple[str | None, str]:
    ctx = _forced.get()
    if op in ctx:
        return ctx[op], "use_backends()"
    env = _env_forced()
    if op in env:
        return env[op], ENV_VAR
    return None, ""


@contextlib.contextmanager
def use_backends(**forced: str) -> Iterator[None]:
    """Force backends inside a ``with`` block, e.g. ``use_backends(conv="torch", ssd="mamba_ssm")``."""
    token = _forced.set({**_forced.get(), **_check_forced(forced, "use_backends")})
    try:
        yield
    finally:
        _forced.reset(token)


def resolve(op: str, *, device: torch.device, dtype: torch.dtype, requires_grad: bool = False,
            backend: str | None = None, inputs: Mapping[str, Any] | None = None) -> Backend:
    """The backend that runs ``op`` on these inputs.

    ``backend`` (or a forced one) must be able to run, else :class:`RuntimeError`; otherwise the
    highest-priority backend that can run is taken.
    """
    source = "backend=" if backend is not None else ""
    if backend is None:
        backend, source = _forced_for(op)
    if backend is not None:
        chosen = get_backend(op, backend)
        why = chosen.reason(device, dtype, requires_grad) or (
            chosen.accepts(inputs) if chosen.accepts is not None and inputs is not None else "")
        if why:
            raise RuntimeError(f"{op} backend {backend!r} (forced by {source}) cannot run here: {why}")
        return chosen
    for candidate in backends_of(op):
        why = candidate.reason(device, dtype, requires_grad)
        if not why and candidate.accepts is not None and inputs is not None:
            why = candidate.accepts(inputs)
            if why:
                key = (op, candidate.name, why)
                if key not in _logged:
                    _logged.add(key)
                    logger.warning("%s: skipping backend %r for these inputs: %s", op, candidate.name, why)
        if not why:
            return candidate
    raise RuntimeError(f"{op}: no backend can run on {device.type} with {dtype}")


def select(op: str, *, device: torch.device | str, dtype: torch.dtype, requires_grad: bool = False) -> str:
    """The name of the backend that will run ``op`` for inputs on ``device`` of ``dtype``.

    Per-call input limits (a conv width, a chunk size, initial states a kernel cannot take) are checked
    when the op runs: such a call goes to the next backend, and the skip is logged once.
    """
    return resolve(op, device=torch.device(device), dtype=dtype, requires_grad=requires_grad).name


def available(op: str | None = None) -> list[BackendStatus]:
    """Every backend of ``op`` (or of every op), with whether it can run on this machine and why not."""
    ops = OPS if op is None else (op,)
    rows = []
    for name in ops:
        for b in backends_of(name):
            why = b.usable_here
            rows.append(BackendStatus(b.op, b.name, not why, why, b.boundary_arg, b.priority, b.backward))
    return rows


def report(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> str:
    """A table a person reads: per op, the backend chosen here, and every alternative with why not."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lines = [f"hybrid_pack backends on {device.type}, {str(dtype).removeprefix('torch.')}, with backward", ""]
    header = f"{'op':<12} {'backend':<16} {'boundaries via':<22} status"
    lines += [header, "-" * len(header)]
    for op in OPS:
        chosen = select(op, device=device, dtype=dtype, requires_grad=True)
        for b in backends_of(op):
            why = b.reason(device, dtype, True)
            status = "CHOSEN" if b.name == chosen else ("ok (lower priority)" if not why else f"no: {why}")
            lines.append(f"{op:<12} {b.name:<16} {b.boundary_arg:<22} {status}")
    return "\n".join(lines)
