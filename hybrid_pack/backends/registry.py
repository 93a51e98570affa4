"""The record of one backend of one op, and the registry that holds them."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

__all__ = ["OPS", "Backend", "register", "backends_of", "get_backend"]

OPS = ("attention", "conv", "gated_delta", "ssd")

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True, eq=False)
class Backend:
    """One implementation of one op that keeps documents apart.

    Attributes:
        op: one of :data:`OPS`.
        name: the name users force it by (``use_backends(conv="torch")``).
        impl: ``"module:function"``, imported on first use; same signature as the public op
            minus ``backend``.
        boundary_arg: how the kernel is told where documents start (shown in reports).
        priority: higher is tried first.
        requires: importable module names the backend needs.
        devices: device types it runs on.
        dtypes: input dtypes it takes.
        backward: whether it has a backward pass.
        probe: extra environment check (versions, drivers); returns "" when fine, else the reason.
        device_probe: extra check of a device and dtype that can change at run time (Triton kernels
            on CPU need the interpreter); returns "" when fine, else the reason. Not cached.
        accepts: per-call input check (widths, channel counts...); returns "" when the kernel can
            take these inputs with boundaries, else the reason. Gets the op's keyword inputs.
    """

    op: str
    name: str
    impl: str
    boundary_arg: str
    priority: int
    requires: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    backward: bool = True
    probe: Callable[[], str] | None = None
    device_probe: Callable[[torch.device, torch.dtype], str] | None = None
    accepts: Callable[[Mapping[str, Any]], str] | None = None
    _reasons: dict = field(default_factory=dict, repr=False)

    @cached_property
    def environment_reason(self) -> str:
        """Why this backend cannot run in this Python environment at all ("" when it can)."""
        for module in self.requires:
            try:
                found = importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return f"package '{module}' is not installed"
        return self.probe() if self.probe is not None else ""

    def reason(self, device: torch.device, dtype: torch.dtype, requires_grad: bool) -> str:
        """Why this backend cannot run on these inputs ("" when it can).

        The static checks are cached per combination; ``device_probe`` is asked every time.
        """
        key = (device.type, dtype, requires_grad)
        if key not in self._reasons:
            self._reasons[key] = (
                self.environment_reason
                or (f"runs on {'/'.join(self.devices)}, not {device.type}" if device.type not in self.devices else "")
                or (f"does not take {dtype}" if dtype not in self.dtypes else "")
                or ("has no backward pass" if requires_grad and not self.backward else "")
            )
        if self._reasons[key] or self.device_probe is None:
            return self._reasons[key]
        return self.device_probe(device, dtype)

    @property
    def usable_here(self) -> str:
        """"" if it can run on some device of this machine, else why not."""
        if self.environment_reason:
            return self.environment_reason
        here = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
        if not any(d in self.devices for d in here):
            return f"needs a {'/'.join(self.devices)} device; this machine has {'/'.join(here)}"
        if self.device_probe is not None:
            reasons = [self.device_probe(torch.device(d), torch.float32) for d in here if d in self.devices]
            if all(reasons):
                return reasons[0]
        return ""

    @cached_property
    def fn(self) -> Callable[..., Any]:
        module, name = self.impl.split(":")
        return getattr(importlib.import_module(module), name)


_REGISTRY: dict[str, list[Backend]] = {op: [] for op in OPS}


def register(backend: Backend) -> Backend:
    """Add a backend; names are unique per op."""
    if backend.op not in _REGISTRY:
        raise ValueError(f"op: expected one of {OPS}; got {backend.op!r}")
    if any(b.name == backend.name for b in _REGISTRY[backend.op]):
        raise ValueError(f"name: backend {backend.name!r} is already registered for op {backend.op!r}")
    _REGISTRY[backend.op].append(backend)
    _REGISTRY[backend.op].sort(key=lambda b: -b.priority)
    return backend


def backends_of(op: str) -> list[Backend]:
    """The backends of ``op``, highest priority first."""
    if op not in _REGISTRY:
        raise ValueError(f"op: expected one of {OPS}; got {op!r}")
    return list(_REGISTRY[op])


def get_backend(op: str, name: str) -> Backend:
    for b in backends_of(op):
        if b.name == name:
            return b
    names = [b.name for b in backends_of(op)]
    raise ValueError(f"backend: {name!r} is not a backend of op {op!r}; choose one of {names}")
