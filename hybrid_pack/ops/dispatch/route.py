"""How a call of an op reaches a backend: the one route every op takes (docs/api.md §4, §5, §9, §9b, §10).

Each op validates its arguments and hands them to its :class:`OpRoute`. The route reads the call's key (op, kind of
boundaries, device, gradients, forcing by argument or :func:`~.selector.use_backends`, the op's cheap ``key`` of
sizes and dtypes) in :data:`verdicts.CHOICES` and calls what it finds: one dictionary look-up per call
(``HYBRID_PACK_BACKENDS`` and ``HYBRID_PACK_VERIFY`` are read when a key is chosen: set them before the run).
A key met for the first time is chosen once (:func:`~.selector.resolve`) and kept, as the callable for the kind of
boundaries:

- :class:`~hybrid_pack.PackedBoundaries` (a whole row) or none (an op without boundaries): the backend itself;
- :class:`~hybrid_pack.boundaries.StaticBoundaries` (a whole row with static shapes): its static form, traced inline
  by ``torch.compile``, or, for a backend without one, the op's opaque node (:mod:`hybrid_pack.ops.library`);
- :class:`~hybrid_pack.boundaries.sharded.ShardedBoundaries` (this rank's slice of a row split across a
  context-parallel group): a sharded backend with its own exchanges, else the op's pure-torch context-parallel path.

Inside ``torch.compile`` the choice is made while tracing by a function the graph takes as a constant; the graph
also reads :data:`verdicts.generation`, so it is traced again whenever a verdict or a registration changes (a graph
traced before the warm-up never keeps the fallback). Inside :func:`hybrid_pack.batch_invariant` a sequence-mixing
op runs its pure-torch backend once per segment (:func:`hybrid_pack.ops.invariant.per_document`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries, StaticBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.compiler import assume_constant_result
from hybrid_pack.ops.cp.relayout import on_contiguous
from hybrid_pack.ops.dispatch import verdicts
from hybrid_pack.ops.dispatch.contract import Signature, dtype_name
from hybrid_pack.ops.dispatch.registry import get_backend
from hybrid_pack.ops.dispatch.selector import forced_context, recording_keys, resolve, resolve_invariant
from hybrid_pack.ops.invariant import SEQUENCE_MIXING, is_batch_invariant, per_document

__all__ = ["OpRoute", "route_of", "dtype_of"]

_ROUTES: dict[str, OpRoute] = {}


@assume_constant_result
def _traced_choice(op: str, device: str, dtype: str, requires_grad: bool, backend: str | None,
                   signature: Signature, described: tuple[tuple[str, Any], ...], static_only: bool,
                   generation: int) -> str:
    """The backend's name for a call traced by ``torch.compile``, a constant of the graph (``generation``: the
    graph is traced again when it changes). Raises :class:`~.selector.WarmUpError` for a kernel left unsettled."""
    inputs = {name: torch.empty(value[1], dtype=getattr(torch, value[2]), device="meta")
              if isinstance(value, tuple) and value[:1] == ("tensor",) else value for name, value in described}
    return resolve(op, device=device, dtype=getattr(torch, dtype), requires_grad=requires_grad, backend=backend,
                   inputs=inputs, signature=signature, traced=True, static_only=static_only).name


@dataclass(frozen=True, eq=False)
class OpRoute:
    """The route of one op's calls.

    Attributes:
        op: the op's name.
        public: the public op (a sharded backend's check calls it with ``backend="torch"``).
        positional: the tensors passed before the boundaries, in order; every other argument goes by keyword.
        key: ``arguments -> tuple``: cheap (sizes, flags, dtypes; no token count), and it fixes ``signature``.
        signature: ``arguments -> Signature`` of a call (what a kernel's correctness may depend on).
        sharded: the op's pure-torch context-parallel path, ``sharded(public, *positional, boundaries, backend=...,
            **keywords)``; None for an op without boundaries.
        opaque: the op as one opaque node of a compiled graph, for backends with no static form (None: only
            backends with a static form serve in a compiled graph).
        from_opaque: ``(outputs, arguments) -> result``: the node's outputs in the op's return convention.
        layouts: the sharded layouts ``sharded`` serves; on another, the per-token tensors move to the contiguous
            layout and back (:mod:`hybrid_pack.ops.cp.relayout`).
    """

    op: str
    public: Callable[..., Any]
    positional: tuple[str, ...]
    key: Callable[[Mapping[str, Any]], tuple[Any, ...]]
    signature: Callable[[Mapping[str, Any]], Signature]
    sharded: Callable[..., Any] | None = None
    opaque: Any = None
    from_opaque: Callable[[list[torch.Tensor], Mapping[str, Any]], Any] | None = None
    layouts: tuple[str, ...] = ("contiguous",)
    mixing: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mixing", self.op in SEQUENCE_MIXING)
        _ROUTES[self.op] = self

    def __call__(self, arguments: dict[str, Any],
                 boundaries: PackedBoundaries | StaticBoundaries | ShardedBoundaries | None, *,
                 backend: str | None, requires_grad: bool) -> Any:
        """Run the op on ``arguments`` (every argument but ``boundaries`` and ``backend``, by name)."""
        if self.mixing and is_batch_invariant():
            return self._invariant(arguments, boundaries, backend, requires_grad)
        if torch.compiler.is_compiling():
            return self._traced(arguments, boundaries, backend, requires_grad)
        kind = type(boundaries)
        if kind is ShardedBoundaries:
            return self._on_shard(arguments, boundaries, backend, requires_grad)
        key = (self.op, kind, arguments[self.positional[0]].device, requires_grad, backend,
               forced_context().get(self.op), self.key(arguments))
        run = verdicts.CHOICES.get(key)
        if run is None:
            run = self._choose(key, arguments, boundaries, backend, requires_grad)
        return run(arguments, boundaries)

    # -- the first call of a key
    def _choose(self, key: tuple[Any, ...], arguments: Mapping[str, Any], boundaries: Any, backend: str | None,
                requires_grad: bool, sharded: tuple[tuple[int, ...], Any] | None = None) -> Callable[..., Any]:
        first = arguments[self.positional[0]]
        chosen = resolve(self.op, device=first.device, dtype=first.dtype, requires_grad=requires_grad,
                         backend=backend,
                         inputs={**arguments, "requires_grad": requires_grad, "boundaries": boundaries},
                         signature=self.signature(arguments), sharded=sharded)
        if sharded is not None and chosen is None:
            run = functools.partial(self._context_parallel, backend=backend)
        elif isinstance(boundaries, StaticBoundaries) and chosen.static_fn is None:
            run = functools.partial(self._opaque, backend=chosen.name, requires_grad=requires_grad)
        else:
            run = self._caller(chosen.static_fn if isinstance(boundaries, StaticBoundaries) else chosen.fn,
                               arguments, boundaries is not None)
        if not recording_keys():  # the discovery pass runs on the pure-torch backends: nothing to keep
            verdicts.CHOICES[key] = run
        return run

    def _on_shard(self, arguments: dict[str, Any], boundaries: ShardedBoundaries, backend: str | None,
                  requires_grad: bool) -> Any:
        boundaries.check_group()
        if boundaries.layout not in self.layouts:
            return on_contiguous(lambda moved, contiguous: self(moved, contiguous, backend=backend,
                                                                requires_grad=requires_grad), arguments, boundaries)
        first = arguments[self.positional[0]]
        ranks = tuple(dist.get_process_group_ranks(boundaries.group or dist.group.WORLD)
                      if dist.is_initialized() else (0,))
        key = (self.op, ShardedBoundaries, first.device, requires_grad, backend, forced_context().get(self.op),
               self.key(arguments), boundaries.layout, ranks)
        run = verdicts.CHOICES.get(key)
        if run is None:
            run = self._choose(key, arguments, boundaries, backend, requires_grad, sharded=(ranks, boundaries.group))
        return run(arguments, boundaries)

    # -- inside torch.compile
    def _traced(self, arguments: dict[str, Any], boundaries: Any, backend: str | None, requires_grad: bool) -> Any:
        first = arguments[self.positional[0]]
        described = tuple((name, ("tensor", tuple(v.shape), dtype_name(v.dtype)) if isinstance(v, torch.Tensor)
                           else v) for name, v in arguments.items())
        described += (("requires_grad", requires_grad),)
        static = boundaries is None or isinstance(boundaries, StaticBoundaries)
        name = _traced_choice(self.op, str(first.device), dtype_name(first.dtype), requires_grad, backend,
                              self.signature(arguments), described, static and self.opaque is None,
                              verdicts.generation)
        chosen = get_backend(self.op, name)
        if not static:  # a plain row traced as it is: the backend's own function
            return self._call(chosen.fn, arguments, boundaries)
        if chosen.static_fn is not None:
            return self._call(chosen.static_fn, arguments, boundaries)
        return self._opaque(arguments, boundaries, backend=name, requires_grad=requires_grad)

    # -- the ways a backend is called
    def _caller(self, fn: Callable[..., Any], arguments: Mapping[str, Any], with_boundaries: bool
                ) -> Callable[[Mapping[str, Any], Any], Any]:
        """``run(arguments, boundaries)`` calling ``fn`` as a backend is called, its argument names laid out now."""
        tensors = operator.itemgetter(*self.positional)
        keywords = tuple(name for name in arguments if name not in self.positional)
        if with_boundaries:
            return lambda a, boundaries: fn(*tensors(a), boundaries, **{name: a[name] for name in keywords})
        return lambda a, _: fn(*tensors(a), **{name: a[name] for name in keywords})

    def _call(self, fn: Callable[..., Any], arguments: Mapping[str, Any], boundaries: Any) -> Any:
        keywords = {name: value for name, value in arguments.items() if name not in self.positional}
        if boundaries is None:
            return fn(*(arguments[name] for name in self.positional), **keywords)
        return fn(*(arguments[name] for name in self.positional), boundaries, **keywords)

    def _context_parallel(self, arguments: Mapping[str, Any], boundaries: ShardedBoundaries, *,
                          backend: str | None) -> Any:
        keywords = {name: value for name, value in arguments.items() if name not in self.positional}
        return self.sharded(self.public, *(arguments[name] for name in self.positional), boundaries,
                            backend=backend, **keywords)

    def _opaque(self, arguments: Mapping[str, Any], boundaries: StaticBoundaries, *, backend: str,
                requires_grad: bool) -> Any:
        node = self.opaque
        tensors = [arguments[name.rstrip("?")] for name in node.tensors]
        options = {name: arguments[name] for name in node.option_names}
        outputs = node(*tensors, cu_seqlens=boundaries.cu_seqlens, backend=backend, requires_grad=requires_grad,
                       **options)
        return self.from_opaque(outputs, arguments)

    def _invariant(self, arguments: Mapping[str, Any], boundaries: Any, backend: str | None,
                   requires_grad: bool) -> Any:
        """Inside :func:`hybrid_pack.batch_invariant`: the pure-torch backend, one canonical call per segment."""
        if not isinstance(boundaries, PackedBoundaries):
            raise InputError(f"boundaries: inside batch_invariant() {self.op} takes a whole row's PackedBoundaries "
                             f"(eager); got {type(boundaries).__name__} (compiled static rows and rows split across "
                             "a context-parallel group are not covered by the mode)")
        first = arguments[self.positional[0]]
        chosen = resolve_invariant(self.op, device=first.device, dtype=first.dtype, requires_grad=requires_grad,
                                   backend=backend)
        return per_document(self.op, chosen.fn, self.positional, arguments, boundaries)


def dtype_of(tensor: torch.Tensor | None) -> torch.dtype | None:
    """An optional input's dtype for a route's ``key`` (None when absent)."""
    return None if tensor is None else tensor.dtype


def route_of(op: str) -> OpRoute:
    """The route of ``op`` (declared where the op is defined)."""
    return _ROUTES[op]
