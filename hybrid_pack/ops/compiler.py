"""``torch.compiler`` decorators that leave ``torch._dynamo`` unimported until a graph is compiled or the function
first runs: importing the ops must not load the compiler stack (nor, through it, FSDP)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["assume_constant_result", "disable"]

Fn = TypeVar("Fn", bound=Callable[..., Any])


def assume_constant_result(fn: Fn) -> Fn:
    """``torch.compiler.assume_constant_result(fn)``: dynamo runs ``fn`` while tracing and keeps its result as a
    constant of the graph. That decorator only sets this mark (tests/ops/test_dispatch.py holds it to that)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def disable(fn: Fn) -> Fn:
    """``torch.compiler.disable(fn, recursive=True)``, with ``torch._dynamo`` imported at the first call."""
    return torch._disable_dynamo(fn, recursive=True)  # type: ignore[return-value]
