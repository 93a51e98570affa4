"""What the self-check must know of an op (each op's ``check.py`` declares one :class:`OpContract`). A call's
*signature* is what a kernel's correctness may depend on besides the tokens (sizes, flags, input dtypes); a backend
is checked once per (device, signature, gradients) on inputs of that signature.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.isolation import least_precise

__all__ = ["Signature", "CheckCase", "OpContract", "make_signature", "specialised", "signature_text", "dtype_name",
           "random_tensor", "projection_weights"]

Signature = tuple[tuple[str, Any], ...]
"""Sorted ``(name, value)`` pairs: sizes, flags and input dtypes (values are ints, bools, strings, None)."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def specialised(sizes: Sequence[Any]) -> tuple[Any, ...]:
    """``sizes`` (and other values) with every int as a Python int: an int ``torch.compile`` made symbolic (automatic
    dynamic shapes, after a recompile for another shape or value) is specialised, guarded, as the static form is
    (``operator.index``; ``int()`` keeps it symbolic), so the backend's choice stays a graph constant."""
    return tuple(operator.index(n) if isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool) else n
                 for n in sizes)  # (dynamo answers isinstance(size, torch.SymInt) with False while it traces)


def make_signature(**items: Any) -> Signature:
    """A signature from sizes, flags and dtypes (dtypes are stored by name; symbolic sizes specialised)."""
    values = specialised(items.values())
    return tuple(sorted((name, dtype_name(v) if isinstance(v, torch.dtype) else v) for name, v in zip(items, values)))


def random_tensor(shape: tuple[int, ...], dtype: str | torch.dtype, device: torch.device,
                  generator: torch.Generator, *, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """``shift + scale * N(0, 1)`` drawn in float32 on the host from ``generator``, then cast and moved."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    values = torch.randn(shape, generator=generator, dtype=torch.float32) * scale + shift
    return values.to(device=device, dtype=dtype)


def projection_weights(outputs: Sequence[torch.Tensor], generator: torch.Generator) -> list[torch.Tensor]:
    """One float64 ``N(0, 1)`` tensor per output, drawn on the host from ``generator``: a random projection."""
    return [torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.device) for t in outputs]


@functools.lru_cache(maxsize=4096)  # asked on every op call; a process sees a few signatures
def signature_text(signature: Signature) -> str:
    """``"D=64 H=4 causal=True q=bfloat16"``: a signature as people (and the on-disk cache) read it."""
    return " ".join(f"{name}={value}" for name, value in signature)


@dataclass(frozen=True)
class CheckCase:
    """The inputs of one call: ``arguments`` (all but ``boundaries``, in the op's order), the names passed
    ``positional``-ly, and those of the per-token ``[1, T, ...]`` and per-document ``[N, ...]`` tensors."""

    arguments: dict[str, Any]
    positional: tuple[str, ...]
    token_inputs: tuple[str, ...]
    document_inputs: tuple[str, ...] = ()

    def call(self, fn: Callable[..., Any], boundaries: PackedBoundaries, arguments: Mapping[str, Any] | None = None
             ) -> Any:
        """``fn(*positional, boundaries, **keywords)`` with these arguments (or replacements of them)."""
        args = self.arguments if arguments is None else arguments
        keywords = {name: value for name, value in args.items() if name not in self.positional}
        return fn(*(args[name] for name in self.positional), boundaries, **keywords)

    def floats(self) -> list[str]:
        """The names of the floating tensor arguments."""
        return [name for name, value in self.arguments.items()
                if isinstance(value, torch.Tensor) and value.is_floating_point()]

    def precision(self) -> torch.dtype:
        """The least precise floating per-token input dtype: it sets the tolerance."""
        return least_precise(self.arguments[name].dtype for name in self.token_inputs
                             if isinstance(self.arguments.get(name), torch.Tensor))

    def sliced(self, arguments: Mapping[str, Any], tokens: slice, documents: slice) -> dict[str, Any]:
        """``arguments`` with the per-token tensors cut to ``tokens`` and the per-document ones to ``documents``."""
        cut = dict(arguments)
        for name, value in arguments.items():
            if isinstance(value, torch.Tensor) and name in self.token_inputs:
                cut[name] = value[:, tokens]
            elif isinstance(value, torch.Tensor) and name in self.document_inputs:
                cut[name] = value[documents]
        return cut

    def leaves(self, requires_grad: Collection[str], arguments: Mapping[str, Any] | None = None, *,
               float64: bool = False) -> dict[str, Any]:
        """Fresh detached copies of the tensors of ``arguments`` (default: these), floating ones in float64 with
        ``float64``; those named in ``requires_grad`` require it."""
        fresh = {}
        for name, value in (self.arguments if arguments is None else arguments).items():
            if isinstance(value, torch.Tensor):
                value = value.detach().double() if float64 and value.is_floating_point() else value.detach()
                value = value.clone().requires_grad_(name in requires_grad)
            fresh[name] = value
        return fresh


@dataclass(frozen=True)
class OpContract:
    """The self-check's view of one op.

    Attributes:
        make_case: ``(signature, boundaries, generator) -> CheckCase`` on ``boundaries.device``.
        outputs: ``result -> (token outputs [1, T, ...], document outputs [N, ...])``.
        default_signature: ``(dtype, device type) -> signature`` of a typical call (``select()``, ``verify()``).
        edge: ``signature -> tokens``: the block length whose edges the check's documents end on.
        reach: ``signature -> tokens`` one token reads back outside a recurrence (a conv's width; 1 otherwise).
        check: the op's own check replacing the generic one (a loss), same arguments; None: :mod:`.selfcheck`.
    """

    name: str
    make_case: Callable[[Signature, PackedBoundaries, torch.Generator], CheckCase]
    outputs: Callable[[Any], tuple[list[torch.Tensor], list[torch.Tensor]]]
    default_signature: Callable[[torch.dtype, str], Signature]
    edge: Callable[[Signature], int]
    reach: Callable[[Signature], int] = lambda signature: 1
    check: Callable[..., float] | None = None
