"""How a call of an op reaches a backend: the one path every op shares (docs/api.md §4, §5, §9, §10).

Each op validates its arguments, then hands them to its :class:`OpRoute`, which goes by the kind of boundaries:

- :class:`~hybrid_pack.PackedBoundaries` (a whole row, eager): the selector's backend for the call
  (:func:`~.selector.resolve`: a local lookup, never a collective);
- :class:`~hybrid_pack.boundaries.StaticBoundaries` (a whole row inside ``torch.compile``): the backend chosen
  while tracing (:func:`~.selector.static_choice`, a constant of the graph); its static form is traced inline
  (static shapes, no host read: the compiler derives the backward and saves what it needs), and a backend with
  no static form runs as the op's opaque node (:mod:`hybrid_pack.ops.library`);
- :class:`~hybrid_pack.parallel.ShardedBoundaries` (this rank's slice of a row split across a context-parallel
  group): a sharded backend with its own exchanges when one serves (:func:`~.selector.resolve_sharded`), else
  the op's pure-torch context-parallel path around the whole-row backends.

Inside :func:`hybrid_pack.batch_invariant` a sequence-mixing op takes none of these paths: its pure-torch backend
(:func:`~.selector.resolve_invariant`) runs once per segment in the segment's canonical row
(:func:`hybrid_pack.ops.invariant.per_document`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries, StaticBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.cp.relayout import on_contiguous
from hybrid_pack.ops.dispatch.contract import Signature, dtype_name
from hybrid_pack.ops.dispatch.registry import get_backend
from hybrid_pack.ops.dispatch.selector import describe, resolve, resolve_invariant, resolve_sharded, static_choice
from hybrid_pack.ops.invariant import SEQUENCE_MIXING, is_batch_invariant, per_document

__all__ = ["OpRoute", "route_of"]

_ROUTES: dict[str, OpRoute] = {}


@dataclass(frozen=True, eq=False)
class OpRoute:
    """The route of one op's calls.

    Attributes:
        op: the op's name.
        public: the public op (the reference of a sharded backend's check calls it with ``backend="torch"``).
        positional: the tensors passed before the boundaries, in order; every other argument goes by keyword.
        signature: ``arguments -> Signature`` of a call (what a kernel's correctness may depend on).
        sharded: the op's pure-torch context-parallel path,
            ``sharded(public, *positional, boundaries, backend=..., **keywords)``.
        opaque: the op as one opaque node of a compiled graph (:class:`~hybrid_pack.ops.library.PackedCustomOp`),
            for backends with no static form.
        from_opaque: ``(outputs, arguments) -> result``: the node's list of outputs in the op's return convention.
        layouts: the :class:`~hybrid_pack.parallel.ShardedBoundaries` layouts ``sharded`` serves; on another, the
            per-token tensors move to the contiguous layout and back (:mod:`hybrid_pack.ops.cp.relayout`).
    """

    op: str
    public: Callable[..., Any]
    positional: tuple[str, ...]
    signature: Callable[[Mapping[str, Any]], Signature]
    sharded: Callable[..., Any]
    opaque: Any
    from_opaque: Callable[[list[torch.Tensor], Mapping[str, Any]], Any]
    layouts: tuple[str, ...] = ("contiguous",)

    def __post_init__(self) -> None:
        _ROUTES[self.op] = self

    def __call__(self, arguments: dict[str, Any], boundaries: PackedBoundaries | StaticBoundaries | ShardedBoundaries,
                 *, backend: str | None, requires_grad: bool) -> Any:
        """Run the op on ``arguments`` (every argument but ``boundaries`` and ``backend``, by name)."""
        first = arguments[self.positional[0]]
        device, dtype = first.device, first.dtype
        signature = self.signature(arguments)
        inputs = {**arguments, "requires_grad": requires_grad}
        if self.op in SEQUENCE_MIXING and is_batch_invariant():
            return self._invariant(arguments, boundaries, device, dtype, backend, requires_grad)
        if isinstance(boundaries, StaticBoundaries):
            name = static_choice(self.op, str(device), dtype_name(dtype), requires_grad, backend, signature,
                                 describe(inputs), not torch.compiler.is_compiling())
            chosen = get_backend(self.op, name)
            if chosen.static_fn is not None:
                return self._call(chosen.static_fn, arguments, boundaries)
            return self._opaque(arguments, boundaries, name, requires_grad)
        if isinstance(boundaries, ShardedBoundaries):
            boundaries.check_group()
            if boundaries.layout not in self.layouts:
                return on_contiguous(lambda moved, contiguous: self(moved, contiguous, backend=backend,
                                                                    requires_grad=requires_grad), arguments, boundaries)
            ranks = tuple(dist.get_process_group_ranks(boundaries.group or dist.group.WORLD)
                          if dist.is_initialized() else (0,))
            chosen = resolve_sharded(self.op, device=device, dtype=dtype, requires_grad=requires_grad, backend=backend,
                                     inputs={**inputs, "boundaries": boundaries}, signature=signature,
                                     group=boundaries.group, group_ranks=ranks)
            if chosen is not None:
                return self._call(chosen.fn, arguments, boundaries)
            keywords = {name: value for name, value in arguments.items() if name not in self.positional}
            return self.sharded(self.public, *(arguments[name] for name in self.positional), boundaries,
                                backend=backend, **keywords)
        chosen = resolve(self.op, device=device, dtype=dtype, requires_grad=requires_grad, backend=backend,
                         inputs=inputs, signature=signature)
        return self._call(chosen.fn, arguments, boundaries)

    def _invariant(self, arguments: Mapping[str, Any], boundaries: Any, device: torch.device, dtype: torch.dtype,
                   backend: str | None, requires_grad: bool) -> Any:
        """Inside :func:`hybrid_pack.batch_invariant`: the pure-torch backend, one canonical call per segment."""
        if not isinstance(boundaries, PackedBoundaries):
            raise InputError(f"boundaries: inside batch_invariant() {self.op} takes a whole row's PackedBoundaries "
                             f"(eager); got {type(boundaries).__name__} (compiled static rows and rows split across "
                             "a context-parallel group are not covered by the mode)")
        chosen = resolve_invariant(self.op, device=device, dtype=dtype, requires_grad=requires_grad, backend=backend)
        return per_document(self.op, chosen.fn, self.positional, arguments, boundaries)

    def _call(self, fn: Callable[..., Any], arguments: Mapping[str, Any], boundaries: Any) -> Any:
        keywords = {name: value for name, value in arguments.items() if name not in self.positional}
        return fn(*(arguments[name] for name in self.positional), boundaries, **keywords)

    def _opaque(self, arguments: Mapping[str, Any], boundaries: StaticBoundaries, backend: str,
                requires_grad: bool) -> Any:
        node = self.opaque
        tensors = [arguments[name.rstrip("?")] for name in node.tensors]
        options = {name: arguments[name] for name in node.option_names}
        outputs = node(*tensors, cu_seqlens=boundaries.cu_seqlens, backend=backend, requires_grad=requires_grad,
                       **options)
        return self.from_opaque(outputs, arguments)


def route_of(op: str) -> OpRoute:
    """The route of ``op`` (declared where the op is defined)."""
    return _ROUTES[op]
