"""The ops as ``torch.library`` custom ops ``hybrid_pack::<op>``: how a compiled graph calls a backend with no static
form (docs/compile.md). The real implementation reads the lengths on the host: from ``host_cu_seqlens``, the batch's
host copy, when given, else from ``cu_seqlens`` (a device-to-host copy on an accelerator); refused in a CUDA graph
capture. The fake gives the output shapes. With gradients, the forward keeps the eager backend's autograd graph for
its backward (the backward runs no second forward, as in eager) behind a one-byte host *handle* output, kept while
the handle lives; the outputs are saved for the backward, which runs the kept graph only on the very memory it holds.
A backward that finds no graph (a second backward of one forward) or other memory (an input a compiler recomputed)
runs the forward again. States are per slot ``[S, ...]``."""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError

__all__ = ["PackedCustomOp"]

_LIBRARY = torch.library.Library("hybrid_pack", "DEF")
_SOURCE = Path(__file__).read_bytes()
_last = threading.local()
_graphs: dict[int, tuple[object, list[torch.Tensor | None], list[torch.Tensor]]] = {}
"""The autograd graphs the forwards kept for their backwards: handle address -> (token, leaves, outputs)."""


def like_first_input(tensors: Sequence[torch.Tensor | None], num_segments: int, **options: Any) -> list[torch.Tensor]:
    """The fake of an op whose one output has the shape and dtype of its first input (attention, the conv)."""
    return [tensors[0].new_empty(tensors[0].shape)]


def _packed_boundaries(op: str, cu_seqlens: torch.Tensor, host_cu_seqlens: torch.Tensor | None = None
                       ) -> PackedBoundaries:
    """The eager boundaries, on ``cu_seqlens``' device, of a static ``cu_seqlens`` (zero-length tail left out),
    read from its host copy ``host_cu_seqlens`` when given; kept for the next call."""
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        raise InputError(f"hybrid_pack::{op}: cannot be captured in a CUDA graph: it reads the documents' lengths "
                         "on the host to build the kernel's layout; compile without mode='reduce-overhead'")
    source = cu_seqlens if host_cu_seqlens is None else host_cu_seqlens
    cached = getattr(_last, "entry", None)
    if cached is not None and cached[0] is source and cached[1] == source._version and cached[2] is cu_seqlens:
        return cached[3]
    boundaries = PackedBoundaries.from_cu_seqlens(source, static=True).to(cu_seqlens.device)
    _last.entry = (source, source._version, cu_seqlens, boundaries)  # holds the tensors: their ids cannot be reused
    return boundaries


def _leaf(t: torch.Tensor | None, requires_grad: bool) -> torch.Tensor | None:
    if t is None:
        return None
    return t.detach().requires_grad_(requires_grad and (t.is_floating_point() or t.is_complex()))


def _no_grad(like: torch.Tensor) -> torch.Tensor:
    """The placeholder gradient of an absent (None) input: an op's outputs cannot be None."""
    return like.new_empty(0, dtype=torch.float32)


def _recording() -> Any:
    """Autograd recording inside an op node's kernel, where the dispatcher leaves it out (below the node's own
    autograd): the thread's dispatch keys with autograd let back in."""
    autograd = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(),
                                           torch._C._dispatch_tls_local_exclude_set() - autograd)


def _new_handle() -> torch.Tensor:
    return torch.empty(1, dtype=torch.uint8, device="cpu")  # on the host whatever the default device


def _keep(leaves: list[torch.Tensor | None], outputs: list[torch.Tensor]) -> torch.Tensor:
    """A handle to the forward's graph: dropped with the handle (a backward that never came, a checkpoint's
    discarded forward), taken by the backward. Keyed by the live handle's address, which no other live tensor has."""
    handle = _new_handle()
    if any(o.requires_grad for o in outputs):  # else nothing was recorded: the backward runs the forward again
        storage, token = handle.untyped_storage(), object()
        _graphs[storage.data_ptr()] = (token, leaves, outputs)
        weakref.finalize(storage, _drop, storage.data_ptr(), token)
    return handle


def _drop(key: int, token: object) -> None:
    if _graphs.get(key, (None,))[0] is token:
        del _graphs[key]


def _take(handle: torch.Tensor, tensors: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor]
          ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]] | None:
    """The graph the forward kept, if the backward was handed the very inputs and outputs it holds: memory kept
    alive for the backward since the forward, which a compiler cannot have reused (an input recomputed for the
    backward, or an output let go, may have been overwritten in place). None: run the forward again."""
    kept = _graphs.pop(handle.untyped_storage().data_ptr(), None)
    if kept is None or not (_same_memory(kept[1], tensors) and _same_memory(kept[2], outputs)):
        return None
    return kept[1], kept[2]


def _same_memory(kept: Sequence[torch.Tensor | None], given: Sequence[torch.Tensor | None]) -> bool:
    return len(kept) == len(given) and all(
        (a is None) == (b is None) and (a is None or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
        for a, b in zip(kept, given, strict=True))


@dataclass(frozen=True)
class PackedCustomOp:
    """One op as ``hybrid_pack::<name>.<overload>`` and ``hybrid_pack::<name>_backward.<overload>`` (the overload
    names this version of the node): ``tensors`` in order (``"bias?"``:
    optional), ``options`` the schema of the rest (``"bool causal, float softmax_scale"``), ``eager`` the public op,
    ``fake(tensors, num_segments, **options)`` its empty outputs, ``state_input`` the initial state's index."""

    name: str
    tensors: tuple[str, ...]
    options: str
    eager: Callable[..., Any]
    fake: Callable[..., Sequence[torch.Tensor]] = like_first_input
    state_input: int | None = None
    overload: str = field(init=False, default="")

    def __post_init__(self) -> None:
        args = ", ".join(f"Tensor{'?' if t.endswith('?') else ''} {t.rstrip('?')}" for t in self.tensors)
        common = ", ".join(part for part in (args, "Tensor cu_seqlens, Tensor? host_cu_seqlens", self.options,
                                             "str? backend") if part)
        schemas = {self.name: f"({common}, bool requires_grad) -> (Tensor[], Tensor)",
                   f"{self.name}_backward": f"(Tensor?[] grads, Tensor handle, Tensor[] outputs, {common}) -> Tensor[]"}
        # The overload is named by this code and the schemas: torch's compile caches know an op by its name only,
        # so a graph compiled against another version of the node is never loaded for this one.
        version = "v" + hashlib.sha1(_SOURCE + repr(schemas).encode()).hexdigest()[:12]
        object.__setattr__(self, "overload", version)
        for name, schema in schemas.items():
            _LIBRARY.define(f"{name}.{version}{schema}")
        _LIBRARY.impl(f"{self.name}.{version}", self._forward, "CompositeExplicitAutograd")
        _LIBRARY.impl(f"{self.name}_backward.{version}", self._backward, "CompositeExplicitAutograd")
        torch.library.register_fake(f"hybrid_pack::{self.name}.{version}", self._fake_forward, lib=_LIBRARY)
        torch.library.register_fake(f"hybrid_pack::{self.name}_backward.{version}", self._fake_backward, lib=_LIBRARY)
        torch.library.register_autograd(f"hybrid_pack::{self.name}.{version}", self._autograd_backward,
                                        setup_context=self._setup_context, lib=_LIBRARY)

    @property
    def option_names(self) -> list[str]:
        return [item.split()[-1] for item in self.options.split(",") if item.strip()]

    def __call__(self, arguments: Mapping[str, Any], cu_seqlens: torch.Tensor, host_cu_seqlens: torch.Tensor | None,
                 *, backend: str | None, requires_grad: bool) -> list[torch.Tensor]:
        """Run the op node on a call's ``arguments`` (by name; :attr:`tensors` and the options among them)."""
        op = getattr(getattr(torch.ops.hybrid_pack, self.name), self.overload)
        outputs, _ = op(*(arguments[name.rstrip("?")] for name in self.tensors), cu_seqlens, host_cu_seqlens,
                        *(arguments[name] for name in self.option_names), backend, requires_grad)
        return outputs

    # -- the parts of a call's arguments
    def _split(self, args: Sequence[Any]) -> tuple[list[Any], tuple[torch.Tensor, torch.Tensor | None],
                                                   dict[str, Any], str | None]:
        """``(tensors, (cu_seqlens, host_cu_seqlens), options, backend)`` of a call's arguments."""
        n, names = len(self.tensors), self.option_names
        return (list(args[:n]), (args[n], args[n + 1]), dict(zip(names, args[n + 2:n + 2 + len(names)])),
                args[n + 2 + len(names)])

    def _run(self, tensors: list[torch.Tensor | None], lengths: tuple[torch.Tensor, torch.Tensor | None],
             options: dict[str, Any], backend: str | None) -> list[torch.Tensor]:
        """The eager op on the non-empty segments; its final state ``[n, ...]`` padded to all ``[S, ...]`` slots with
        the initial states (or zeros)."""
        cu_seqlens = lengths[0]
        boundaries = _packed_boundaries(self.name, *lengths)
        given = list(tensors)
        initial = tensors[self.state_input] if self.state_input is not None else None
        if initial is not None:
            given[self.state_input] = initial[:boundaries.num_segments]
        out = self.eager(*given, boundaries, backend=backend, **options)
        outputs = list(out) if isinstance(out, tuple) else [out]
        if len(outputs) == 2 and outputs[1] is not None:
            state = outputs[1]
            rest = (initial[state.shape[0]:].to(state.dtype) if initial is not None
                    else state.new_zeros((cu_seqlens.shape[0] - 1 - state.shape[0], *state.shape[1:])))
            outputs[1] = torch.cat([state, rest])
        return [o for o in outputs if o is not None]

    # -- forward
    def _forward(self, *args: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        tensors, lengths, options, backend = self._split(args[:-1])
        requires_grad = args[-1]
        # The same backend as the backward's recomputation: both select with requires_grad as given.
        leaves = [_leaf(t, requires_grad) for t in tensors]
        with torch.enable_grad() if requires_grad else torch.no_grad(), _recording():
            outputs = self._run(leaves, lengths, options, backend)
        return [o.detach() for o in outputs], _keep(leaves, outputs) if requires_grad else _new_handle()

    def _fake_forward(self, *args: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        tensors, (cu_seqlens, _), options, _ = self._split(args[:-1])
        return list(self.fake(tensors, cu_seqlens.shape[0] - 1, **options)), _new_handle()

    # -- backward
    def _setup_context(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        tensors, lengths, options, backend = self._split(inputs[:-1])
        ctx.save_for_backward(*tensors, *lengths, output[1], *output[0])  # outputs too: alive until the backward
        ctx.options, ctx.backend = options, backend

    def _autograd_backward(self, ctx: Any, grads: Sequence[torch.Tensor | None], _: Any) -> tuple[Any, ...]:
        saved, count = ctx.saved_tensors, len(self.tensors)
        tensors, lengths, handle = saved[:count], saved[count:count + 2], saved[count + 2]
        outputs = list(saved[count + 3:])
        op = getattr(getattr(torch.ops.hybrid_pack, f"{self.name}_backward"), self.overload)
        out = op(list(grads), handle, outputs, *tensors, *lengths, *(ctx.options[n] for n in self.option_names),
                 ctx.backend)
        input_grads = [g if needed and t is not None else None
                       for g, t, needed in zip(out, tensors, ctx.needs_input_grad, strict=False)]
        return (*input_grads, *([None] * (len(ctx.needs_input_grad) - len(tensors))))

    def _backward(self, grads: list[torch.Tensor | None], handle: torch.Tensor, outputs: list[torch.Tensor],
                  *args: Any) -> list[torch.Tensor]:
        tensors, lengths, options, backend = self._split(args)
        kept = _take(handle, tensors, outputs)
        with torch.enable_grad(), _recording():
            if kept is None:
                leaves = [_leaf(t, True) for t in tensors]
                recorded = self._run(leaves, lengths, options, backend)
            else:
                leaves, recorded = kept
            pairs = [(o, g) for o, g in zip(recorded, grads, strict=False) if g is not None and o.requires_grad]
            wrt = [t for t in leaves if t is not None and t.requires_grad]
            got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], materialize_grads=True)
                       if pairs and wrt else map(torch.zeros_like, wrt))
        return [_no_grad(lengths[0]) if t is None else next(got) if t.requires_grad else torch.zeros_like(t)
                for t in leaves]

    def _fake_backward(self, grads: list[Any], handle: Any, outputs: Any, *args: Any) -> list[torch.Tensor]:
        tensors, (cu_seqlens, _), _, _ = self._split(args)
        return [torch.empty_like(t) if t is not None else _no_grad(cu_seqlens) for t in tensors]
