"""How a call of an op reaches a backend (docs/architecture.md; docs/api.md §4, §5, §9b, §10): each op's
:class:`OpRoute` looks the call's key up in :data:`verdicts.CHOICES`, filled once per key (:func:`~.selector.resolve`).
A trace keeps the choice as a graph constant, re-traced when :data:`verdicts.generation` changes; a sharded row runs
eagerly in a graph; inside :func:`hybrid_pack.batch_invariant` a sequence-mixing op runs pure torch per segment."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries, StaticBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.errors import BackendUnavailableError, InputError
from hybrid_pack.ops.compiler import assume_constant_result
from hybrid_pack.ops.cp.eager import run_eagerly
from hybrid_pack.ops.cp.relayout import on_contiguous
from hybrid_pack.ops.dispatch import verdicts
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.discovery import recording_keys
from hybrid_pack.ops.dispatch.registry import get_backend
from hybrid_pack.ops.dispatch.selector import WarmUpError, forced_context, resolve, resolve_invariant
from hybrid_pack.ops.invariant import SEQUENCE_MIXING, inside_batch_invariant, is_batch_invariant, per_document
from hybrid_pack.ops.selfcheck.contract import Signature, dtype_name, specialised

__all__ = ["OpRoute", "route_of"]

_ROUTES: dict[str, OpRoute] = {}


@assume_constant_result
def _traced_choice(op: str, device: str, dtype: str, requires_grad: bool, backend: str | None,
                   signature: Signature, described: tuple[tuple[str, Any], ...], static_only: bool,
                   generation: int) -> str:
    """The backend's name for a traced call: a graph constant (re-traced when ``generation`` changes)."""
    inputs = {name: torch.empty(value[1], dtype=getattr(torch, value[2]), device="meta")
              if isinstance(value, tuple) and value[:1] == ("tensor",) else value for name, value in described}
    try:
        return resolve(op, device=device, dtype=getattr(torch, dtype), requires_grad=requires_grad, backend=backend,
                       inputs=inputs, signature=signature, traced=True, static_only=static_only).name
    except tuple(_RAISED.values()) as error:  # raised by the traced code itself (dynamo would wrap it here)
        kind = next(name for name, raised in _RAISED.items() if isinstance(error, raised))
        return f"{_REFUSED}{kind}:{error}"


_REFUSED = "\x00refused:"
_RAISED = {kind.__name__: kind for kind in (WarmUpError, BackendUnavailableError, InputError)}  # narrowest first


@dataclass(frozen=True, eq=False)
class OpRoute:
    """The route of one op's calls.

    Attributes:
        public: the public op (a sharded backend's check calls it with ``backend="torch"``).
        positional: the names of the tensors passed before the boundaries; every other argument goes by keyword.
        key: ``(tensors, options) -> tuple``: cheap (sizes, flags, dtypes; no token count); it fixes ``signature``.
        signature: ``arguments -> Signature`` of a call (its arguments by name).
        sharded: the op's pure-torch context-parallel path, ``sharded(public, *positional, boundaries, backend=...,
            **keywords)``; None for an op without boundaries.
        opaque, from_opaque: the op's opaque node for backends without a static form, and ``(outputs, arguments) ->
            result`` (None: only backends with a static form serve in a compiled graph).
        layouts: the sharded layouts ``sharded`` serves; others are moved to the contiguous layout and back.
    """

    op: str
    public: Callable[..., Any]
    positional: tuple[str, ...]
    key: Callable[[tuple[torch.Tensor, ...], Mapping[str, Any]], tuple[Any, ...]]
    signature: Callable[[Mapping[str, Any]], Signature]
    sharded: Callable[..., Any] | None = None
    opaque: Any = None
    from_opaque: Callable[[list[torch.Tensor], Mapping[str, Any]], Any] | None = None
    layouts: tuple[str, ...] = ("contiguous",)
    mixing: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mixing", self.op in SEQUENCE_MIXING)
        _ROUTES[self.op] = self

    def __call__(self, tensors: tuple[torch.Tensor, ...], options: dict[str, Any],
                 boundaries: PackedBoundaries | StaticBoundaries | ShardedBoundaries | None, *,
                 backend: str | None, requires_grad: bool) -> Any:
        """Run the op on ``tensors`` (those named :attr:`positional`, in order) and ``options`` (every other
        argument but ``boundaries`` and ``backend``, by name), as a backend is called:
        ``fn(*tensors, boundaries, **options)``."""
        if torch.compiler.is_compiling():
            if type(boundaries) is ShardedBoundaries:  # exchanges and host-side layout stay out of the graph
                return run_eagerly(self.by_name, self.arguments(tensors, options), boundaries, backend,
                                   requires_grad)
            if self.mixing and is_batch_invariant():
                return self._invariant(tensors, options, boundaries, backend, requires_grad)
            return self._traced(tensors, options, boundaries, backend, requires_grad)
        if self.mixing and inside_batch_invariant():
            return self._invariant(tensors, options, boundaries, backend, requires_grad)
        sharded = None
        if type(boundaries) is ShardedBoundaries:
            boundaries.check_group()
            if boundaries.layout not in self.layouts:
                return on_contiguous(functools.partial(self.by_name, backend=backend, requires_grad=requires_grad),
                                     self.arguments(tensors, options), boundaries)
            sharded = (tuple(dist.get_process_group_ranks(boundaries.group or dist.group.WORLD)
                             if dist.is_initialized() else (0,)), boundaries.group)
        key = (self.op, type(boundaries), tensors[0].device, requires_grad, backend, forced_context().get(self.op),
               self.key(tensors, options))
        if sharded is not None:
            key += (boundaries.layout, sharded[0])
        run = verdicts.CHOICES.get(key)
        if run is None:
            run = self._choose(key, tensors, options, boundaries, backend, requires_grad, sharded)
        return run(tensors, options, boundaries)

    def arguments(self, tensors: tuple[torch.Tensor, ...], options: Mapping[str, Any]) -> dict[str, Any]:
        """A call's arguments by name (every one but ``boundaries`` and ``backend``)."""
        return {**dict(zip(self.positional, tensors, strict=True)), **options}

    def by_name(self, arguments: Mapping[str, Any], boundaries: Any, *, backend: str | None,
                requires_grad: bool) -> Any:
        """The call of :meth:`__call__` with its arguments by name."""
        options = {name: value for name, value in arguments.items() if name not in self.positional}
        return self(tuple(arguments[name] for name in self.positional), options, boundaries, backend=backend,
                    requires_grad=requires_grad)

    def _choose(self, key: tuple[Any, ...], tensors: tuple[torch.Tensor, ...], options: Mapping[str, Any],
                boundaries: Any, backend: str | None, requires_grad: bool,
                sharded: tuple[tuple[int, ...], Any] | None) -> Callable[..., Any]:
        """The callable serving a key met for the first time."""
        first, arguments = tensors[0], self.arguments(tensors, options)
        chosen = resolve(self.op, device=first.device, dtype=first.dtype, requires_grad=requires_grad, backend=backend,
                         inputs={**arguments, "requires_grad": requires_grad, "boundaries": boundaries},
                         signature=self.signature(arguments), sharded=sharded)
        if chosen is None:  # a sharded row no sharded backend serves: the op's pure-torch context-parallel path
            run = _caller(functools.partial(self.sharded, self.public, backend=backend), True)
        else:
            run = self._runner(chosen, isinstance(boundaries, StaticBoundaries), boundaries is not None,
                               requires_grad)
        if not recording_keys():  # the discovery pass runs on the pure-torch backends: nothing to keep
            verdicts.CHOICES[key] = run
        return run

    def _traced(self, tensors: tuple[torch.Tensor, ...], options: Mapping[str, Any], boundaries: Any,
                backend: str | None, requires_grad: bool) -> Any:
        first, arguments = tensors[0], self.arguments(tensors, options)
        described = tuple((name, ("tensor", specialised(v.shape), dtype_name(v.dtype))) if isinstance(v, torch.Tensor)
                          else (name, *specialised((v,))) for name, v in arguments.items())
        described += (("requires_grad", requires_grad),)
        static = boundaries is None or isinstance(boundaries, StaticBoundaries)  # an op without boundaries too
        name = _traced_choice(self.op, str(first.device), dtype_name(first.dtype), requires_grad, backend,
                              self.signature(arguments), described, static and self.opaque is None,
                              verdicts.generation)
        if name.startswith(_REFUSED):
            kind, _, message = name.removeprefix(_REFUSED).partition(":")
            raise _RAISED[kind](message)
        run = self._runner(get_backend(self.op, name), static, boundaries is not None, requires_grad)
        return run(tensors, options, boundaries)

    def _runner(self, chosen: Backend, static: bool, with_boundaries: bool, requires_grad: bool
                ) -> Callable[[tuple[torch.Tensor, ...], Mapping[str, Any], Any], Any]:
        """``run(tensors, options, boundaries)`` of ``chosen``: its static form when ``static`` (the op's opaque node
        if it has none), else its function."""
        fn = chosen.static_fn if static else chosen.fn
        if fn is None:
            return functools.partial(self._opaque, backend=chosen.name, requires_grad=requires_grad)
        return _caller(fn, with_boundaries)

    def _opaque(self, tensors: tuple[torch.Tensor, ...], options: Mapping[str, Any], boundaries: StaticBoundaries,
                *, backend: str, requires_grad: bool) -> Any:
        arguments = self.arguments(tensors, options)
        outputs = self.opaque(arguments, boundaries.cu_seqlens, boundaries.host_cu_seqlens, backend=backend,
                              requires_grad=requires_grad)
        return self.from_opaque(outputs, arguments)

    def _invariant(self, tensors: tuple[torch.Tensor, ...], options: Mapping[str, Any], boundaries: Any,
                   backend: str | None, requires_grad: bool) -> Any:
        if not isinstance(boundaries, PackedBoundaries):
            raise InputError(f"boundaries: inside batch_invariant() {self.op} takes a whole row's PackedBoundaries "
                             f"(eager); got {type(boundaries).__name__} (compiled static rows and rows split across "
                             "a context-parallel group are not covered by the mode)")
        first = tensors[0]
        chosen = resolve_invariant(self.op, device=first.device, dtype=first.dtype, requires_grad=requires_grad,
                                   backend=backend)
        return per_document(self.op, chosen.fn, tensors, options, boundaries)


def _caller(fn: Callable[..., Any], with_boundaries: bool
            ) -> Callable[[tuple[torch.Tensor, ...], Mapping[str, Any], Any], Any]:
    """``run(tensors, options, boundaries)`` calling ``fn`` as a backend is called."""
    if with_boundaries:
        return lambda tensors, options, boundaries: fn(*tensors, boundaries, **options)
    return lambda tensors, options, _: fn(*tensors, **options)


def route_of(op: str) -> OpRoute:
    """The route of ``op`` (declared where the op is defined)."""
    return _ROUTES[op]
