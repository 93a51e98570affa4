"""One implementation of one op: what it needs to run, and why it cannot run here."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from hybrid_pack.ops.selfcheck.contract import dtype_name
from hybrid_pack.ops.selfcheck.kept import code_fingerprint

__all__ = ["Backend", "FLOAT_DTYPES", "KERNEL_DTYPES"]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _imported(impl: Callable[..., Any] | str) -> Callable[..., Any]:
    """``impl`` itself, or the function a ``"module:function"`` string names."""
    if callable(impl):
        return impl
    module, name = impl.split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, eq=False)
class Backend:
    """One implementation of one op that keeps documents apart (docs/api.md §5a).

    ``impl`` (or ``"module:function"``, imported on first use) is called as the public op minus ``backend``: tensors
    and ``boundaries`` positionally, the rest as keywords. ``priority``: higher first (pure torch: 0); ``reference``:
    the pure-torch oracle (serves unchecked); ``requires``: modules it imports; ``probe()`` (asked once),
    ``device_probe(device, dtype)`` (every time) and ``accepts(inputs by name)`` (per call): "" or why not;
    ``limits``: what ``accepts`` refuses, in words; ``sharded``: serves a row split across a context-parallel group
    itself (checked collectively); ``static``: the same on StaticBoundaries with no host read, traced inline by
    ``torch.compile`` (without one the op's opaque node serves, :mod:`hybrid_pack.ops.library`).
    """

    op: str
    name: str
    impl: Callable[..., Any] | str
    priority: int
    reference: bool = False
    boundary_arg: str = ""
    requires: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cuda",)
    dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES
    backward: bool = True
    probe: Callable[[], str] | None = None
    device_probe: Callable[[torch.device, torch.dtype], str] | None = None
    accepts: Callable[[Mapping[str, Any]], str] | None = None
    limits: str = ""
    sharded: bool = False
    static: Callable[..., Any] | str | None = None
    _reasons: dict[tuple[str, torch.dtype, bool], str] = field(default_factory=dict, repr=False)

    @cached_property
    def fn(self) -> Callable[..., Any]:
        return _imported(self.impl)

    @cached_property
    def static_fn(self) -> Callable[..., Any] | None:
        return _imported(self.static) if self.static is not None else None

    @cached_property
    def fingerprint(self) -> str:
        """``module:function@hash`` of the code that runs (names a kept result); for a ``"module:function"`` that
        cannot be imported, the string and the error (its check raises that error)."""
        try:
            return code_fingerprint(self.fn)
        except (ImportError, AttributeError) as error:
            return f"{self.impl}@{type(error).__name__}"

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
        """Why this backend cannot run on these inputs ("" when it can), before any self-check."""
        key = (device.type, dtype, requires_grad)
        if key not in self._reasons:
            self._reasons[key] = (
                self.environment_reason
                or (f"runs on {'/'.join(self.devices)}, not {device.type}" if device.type not in self.devices else "")
                or (f"does not take {dtype_name(dtype)}" if dtype not in self.dtypes else "")
                or ("has no backward pass" if requires_grad and not self.backward else "")
            )
        if self._reasons[key] or self.device_probe is None:
            return self._reasons[key]
        return self.device_probe(device, dtype)
