"""The registry of ops (their self-check contracts) and of each op's backends, highest priority first."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from hybrid_pack.errors import InputError
from hybrid_pack.ops.dispatch import verdicts
from hybrid_pack.ops.dispatch.backend import KERNEL_DTYPES, Backend
from hybrid_pack.ops.selfcheck.contract import OpContract

__all__ = ["register_op", "registered_ops", "contract_of", "register", "unregister", "backends_of", "get_backend",
           "reference_of", "default_device"]

_CONTRACTS: dict[str, OpContract] = {}
_BACKENDS: dict[str, list[Backend]] = {}


def register_op(contract: OpContract) -> None:
    """Declare an op and how the self-check exercises it (each op folder does this once)."""
    if contract.name in _CONTRACTS:
        raise InputError(f"op: {contract.name!r} is already registered")
    _CONTRACTS[contract.name] = contract
    _BACKENDS[contract.name] = []


def registered_ops() -> tuple[str, ...]:
    """Every op's name, in registration order."""
    return tuple(_CONTRACTS)


def contract_of(op: str) -> OpContract:
    if op not in _CONTRACTS:
        raise InputError(f"op: expected one of {list(_CONTRACTS)}; got {op!r}")
    return _CONTRACTS[op]


def register(op: str | Backend, name: str | None = None, fn: Callable[..., Any] | str | None = None, *,
             priority: int | None = None, devices: tuple[str, ...] = ("cuda",),
             dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES, backward: bool = True, replace: bool = False,
             **details: Any) -> Backend:
    """Add a backend ``name`` for ``op`` (or a ready :class:`Backend`), docs/api.md §5a: ``fn`` (or
    ``"module:function"``) is called as the op (docs/api.md §4, no ``backend``) and serves a call only after passing
    its self-check; ``priority`` is required (higher first; pure torch is 0); ``replace`` an existing name instead of
    raising; ``details``: the other :class:`Backend` fields. Returns the registered backend."""
    if isinstance(op, Backend):
        backend = op
    elif name is None or fn is None or priority is None:
        raise InputError("register: expected register(op, name, fn, priority=...)")
    else:
        for field, value, kind in (("devices", devices, str), ("dtypes", dtypes, torch.dtype)):
            if isinstance(value, (str, torch.dtype)) or not all(isinstance(v, kind) for v in value):
                raise InputError(f"{field}: expected a tuple of {kind.__name__} such as "
                                 f"{('cuda',) if kind is str else (torch.bfloat16,)}; got {value!r}")
        backend = Backend(op=op, name=name, impl=fn, priority=priority, devices=tuple(devices),
                          dtypes=tuple(dtypes), backward=backward, **details)
    contract_of(backend.op)
    _refuse_malformed(backend)
    if any(b.name == backend.name for b in _BACKENDS[backend.op]):
        if not replace:
            raise InputError(f"name: backend {backend.name!r} is already registered for op {backend.op!r} "
                             "(pass replace=True to replace it)")
        unregister(backend.op, backend.name)
    backend.static_fn  # noqa: B018  (resolved now: a compiled graph reads it while tracing)
    _BACKENDS[backend.op].append(backend)
    _BACKENDS[backend.op].sort(key=lambda b: -b.priority)
    verdicts.forget(backend.op, backend.name)
    return backend


def _refuse_malformed(backend: Backend) -> None:
    """InputError naming the field of ``backend`` that cannot be used (priority, devices, reference, sharded, fn)."""
    lowest = 0 if backend.reference or backend.sharded else 1
    if not isinstance(backend.priority, numbers.Integral) or isinstance(backend.priority, bool) \
            or backend.priority < lowest:
        raise InputError(f"priority: expected an int >= {lowest} (the pure-torch backends are 0, the lowest); got "
                         f"{backend.priority!r}")
    for device in backend.devices:
        try:
            if torch.device(device).type != device:
                raise RuntimeError
        except RuntimeError:
            raise InputError(f"devices: expected device types such as ('cuda',) or ('cpu', 'cuda'); got "
                             f"{backend.devices!r}") from None
    if backend.reference and backend.sharded:
        raise InputError(f"sharded: the reference backend of {backend.op!r} serves whole rows; a sharded row's "
                         "reference is the op's own context-parallel path")
    others = [b.name for b in _BACKENDS[backend.op] if b.reference and b.name != backend.name]
    if backend.reference and others:
        raise InputError(f"reference: op {backend.op!r} has its pure-torch reference {others[0]!r} (the oracle every "
                         "check compares with, serving unchecked); register a kernel without reference=True")
    if isinstance(backend.impl, str) and not all(backend.impl.partition(":")[::2]):
        raise InputError(f"fn: expected a callable or 'module:function'; got {backend.impl!r}")
    if not isinstance(backend.impl, str) and not callable(backend.impl):
        raise InputError(f"fn: expected a callable or 'module:function'; got {type(backend.impl).__name__}")


def unregister(op: str, name: str) -> Backend:
    """Remove a backend (and forget its check results); returns it."""
    backend = get_backend(op, name)
    _BACKENDS[op].remove(backend)
    verdicts.forget(op, name)
    return backend


def backends_of(op: str, *, sharded: bool | None = False) -> list[Backend]:
    """The backends of ``op``, highest priority first: those serving whole rows (default), those serving
    sharded rows (``sharded=True``), or all (``sharded=None``)."""
    contract_of(op)
    return [b for b in _BACKENDS[op] if sharded is None or b.sharded == sharded]


def get_backend(op: str, name: str) -> Backend:
    for b in backends_of(op, sharded=None):
        if b.name == name:
            return b
    names = [b.name for b in backends_of(op, sharded=None)]
    raise InputError(f"backend: {name!r} is not a backend of op {op!r}; choose one of {names}")


def reference_of(op: str) -> Backend:
    """The pure-torch backend of ``op``: the self-check's oracle and the fallback of last resort."""
    for b in backends_of(op):
        if b.reference:
            return b
    raise InputError(f"op: {op!r} has no reference (pure-torch) backend registered")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
