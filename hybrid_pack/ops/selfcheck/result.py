"""The result of one self-check, and the name of the device it ran on."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybrid_pack.ops.triton_device import cpu_interpreter_enabled

__all__ = ["CheckResult", "Implementation", "device_name"]


class Implementation(Protocol):
    """What a check runs: one backend of ``op`` (a :class:`~hybrid_pack.ops.dispatch.backend.Backend`), ``fn``
    called as the op."""

    op: str
    name: str
    fn: Callable[..., Any]


@dataclass(frozen=True)
class CheckResult:
    """One self-check of one backend (docs/api.md §5a): ``ok``, ``reason`` ("" when ok), ``max_error`` (the largest
    relative difference measured; NaN when none), ``seconds``, the ``device`` name, the ``dtype`` that set the
    tolerance, the ``signature`` as text and ``requires_grad`` (the backward was checked)."""

    op: str
    backend: str
    ok: bool
    reason: str
    max_error: float
    seconds: float
    device: str = ""
    dtype: str = ""
    signature: str = ""
    requires_grad: bool = True


def device_name(device: torch.device) -> str:
    """``"cuda NVIDIA H100 80GB HBM3"``, ``"cpu"`` or ``"cpu (Triton interpreter)"``: what a result was measured on."""
    if device.type == "cuda":
        return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())
    if device.type == "cpu" and cpu_interpreter_enabled():
        return "cpu (Triton interpreter)"
    return device.type


@functools.cache
def _cuda_name(index: int) -> str:
    return f"cuda {torch.cuda.get_device_name(index)}"
