"""Conventions shared by the public ops: packed inputs are ``[1, T, ...]`` matching the boundaries; recurrent
states are float32 (float64 for float64 inputs)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.selfcheck.contract import specialised

AnyBoundaries = PackedBoundaries | StaticBoundaries | ShardedBoundaries
"""What the public ops take: a whole row (eager or compiled), or one rank's slice of a row (docs/api.md §10)."""


def local_boundaries(boundaries: AnyBoundaries) -> PackedBoundaries | StaticBoundaries:
    """The boundaries of the tokens this process holds: ``boundaries.local`` for a :class:`ShardedBoundaries`
    (its segments, pieces of documents where a rank edge cuts one), ``boundaries`` itself otherwise."""
    return boundaries.local if isinstance(boundaries, ShardedBoundaries) else boundaries


def document_slots(boundaries: AnyBoundaries) -> int:
    """Rows of a call's per-document tensors (``initial_state``, final states): one per document, one per local
    document on a :class:`ShardedBoundaries`, one per segment slot with :class:`StaticBoundaries`."""
    if isinstance(boundaries, StaticBoundaries):
        return boundaries.num_segments
    return local_boundaries(boundaries).num_docs


def packed_tokens(boundaries: AnyBoundaries, device: torch.device) -> int | None:
    """``T``, the tokens ``boundaries`` describe here (``boundaries.local.total_tokens`` on a shard), when they are
    on ``device``; None when they are elsewhere or are not boundaries.

    The ops' common path: they compare every input's shape with the shapes ``T`` and the other sizes imply in one
    tuple comparison, and run the checks naming the field at fault (:func:`check_packed`, :func:`check_shape`)
    only when it fails."""
    kind = type(boundaries)
    if kind is ShardedBoundaries:
        boundaries = boundaries.local
    elif kind is not PackedBoundaries and kind is not StaticBoundaries:
        return None
    return boundaries.total_tokens if boundaries.device == device else None


def shape_of(x: torch.Tensor | None) -> torch.Size | None:
    """``x.shape``, None for an absent optional input (what the ops' one comparison holds for it)."""
    return None if x is None else x.shape


def check_packed(name: str, x: torch.Tensor, boundaries: AnyBoundaries, ndim: int) -> None:
    """Raise InputError unless ``x`` is ``[1, T, ...]`` with ``ndim`` dims and ``T`` the tokens the boundaries
    describe here (``boundaries.total_tokens``; ``boundaries.local.total_tokens`` on a shard), on their device."""
    kind = type(boundaries)
    if kind is PackedBoundaries or kind is StaticBoundaries:  # the common case first: a few comparisons per call
        shape = x.shape
        if len(shape) == ndim and shape[0] == 1 and shape[1] == boundaries.total_tokens and \
                x.device == boundaries.device:
            return
    if not isinstance(boundaries, (PackedBoundaries, StaticBoundaries, ShardedBoundaries)):
        raise InputError(f"boundaries: expected a PackedBoundaries (PackedBoundaries.from_batch(batch)) or a "
                         f"ShardedBoundaries (shard_batch(batch)); got {type(boundaries).__name__}")
    here = local_boundaries(boundaries)
    field = "boundaries.local.total_tokens" if here is not boundaries else "boundaries.total_tokens"
    if x.dim() != ndim:
        raise InputError(f"{name}: expected {ndim} dims [1, T, ...]; got shape {list(x.shape)}")
    if x.shape[0] != 1:
        raise InputError(f"{name}: expected batch size 1 (packed rows are [1, T, ...]; pack the batch with "
                         f"PackingCollator); got shape {list(x.shape)}")
    if x.device != here.device:
        raise InputError(f"boundaries: on {here.device} but {name} is on {x.device}; "
                         f"move them with boundaries.to({name}.device)")
    if x.shape[1] != here.total_tokens:
        raise InputError(f"{name}: expected T = {here.total_tokens} tokens ({field}); got shape {list(x.shape)}")


def on_device(device: torch.device, *tensors: torch.Tensor | None) -> bool:
    """Whether every tensor given (None: absent) is on ``device``: the ops' common path (a loop, no generator)."""
    for t in tensors:  # noqa: SIM110  (all() over a generator costs more on every op call)
        if t is not None and t.device != device:
            return False
    return True


def check_devices(reference: str, x: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise InputError naming the first tensor of ``others`` (None: absent) not on the device of ``x`` (the
    argument named ``reference``)."""
    for name, t in others.items():
        if t is not None and t.device != x.device:
            raise InputError(f"{name}: on {t.device} but {reference} is on {x.device}; move it with "
                             f"{name}.to({reference}.device)")


def check_sizes(name: str, x: torch.Tensor) -> None:
    """Raise InputError unless every size of ``x`` after ``[1, T`` (heads, head dims, channels) is at least 1."""
    if 0 in x.shape[2:]:
        raise InputError(f"{name}: expected sizes of at least 1 after [1, T]; got shape {list(x.shape)}")


def check_shape(name: str, x: torch.Tensor | None, expected: tuple[int, ...]) -> None:
    """Raise InputError unless ``x`` (when given) has exactly the ``expected`` shape."""
    if x is not None and x.shape != expected:  # torch.Size is a tuple
        raise InputError(f"{name}: expected shape {list(expected)}; got {list(x.shape)}")


def check_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None, boundaries: AnyBoundaries, *, per_key_gate: bool) -> None:
    """Raise InputError naming the first input at fault unless ``q, k`` are ``[1, T, H, K]``, ``v`` ``[1, T, HV, V]``
    with ``HV % H == 0``, ``g`` ``[1, T, HV]`` (``[1, T, HV, K]`` with ``per_key_gate``), ``beta`` ``[1, T, HV]``,
    ``initial_state`` ``[N, HV, K, V]`` (:func:`document_slots`), all on the boundaries' device. The common path is
    one tuple comparison; the checks naming the field run only when it fails."""
    q_shape, v_shape = q.shape, v.shape
    if len(q_shape) == 4 and len(v_shape) == 4 and q_shape[2] and q_shape[3] and v_shape[2] and v_shape[3] \
            and v_shape[2] % q_shape[2] == 0:
        _, _, h, k_dim = q_shape
        _, _, hv, v_dim = v_shape
        device = q.device
        t_len = packed_tokens(boundaries, device)  # None: not boundaries, or elsewhere
        states = None if initial_state is None or t_len is None else (document_slots(boundaries), hv, k_dim, v_dim)
        gate = (1, t_len, hv, k_dim) if per_key_gate else (1, t_len, hv)
        if (q_shape, k.shape, v_shape, g.shape, beta.shape, shape_of(initial_state), k.device, v.device, g.device,
                beta.device) == ((1, t_len, h, k_dim), q_shape, (1, t_len, hv, v_dim), gate, (1, t_len, hv), states,
                                 device, device, device, device) and on_device(device, initial_state):
            return
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_packed(name, t, boundaries, 4)
        check_sizes(name, t)
    check_shape("k", k, q.shape)
    _, t_len, h, k_dim = q.shape
    hv, v_dim = v.shape[2], v.shape[3]
    if hv % h:
        raise InputError(f"v: expected a number of value heads that is a multiple of q's {h}; got {hv}")
    check_shape("g", g, (1, t_len, hv, k_dim) if per_key_gate else (1, t_len, hv))
    check_shape("beta", beta, (1, t_len, hv))
    check_devices("q", q, g=g, beta=beta, initial_state=initial_state)
    check_shape("initial_state", initial_state, (document_slots(boundaries), hv, k_dim, v_dim))


def delta_rule_key(tensors: tuple[torch.Tensor, ...], options: dict[str, Any]) -> tuple[Any, ...]:
    """A delta rule's route key (gated delta, KDA): the sizes but ``T``, the flags and the dtypes."""
    q, k, v, g, beta = tensors
    initial_state = options["initial_state"]
    _, _, h, k_dim = q.shape
    _, _, hv, v_dim = v.shape
    return (h, k_dim, hv, v_dim, options["use_qk_l2norm"], options["output_final_state"], q.dtype, k.dtype, v.dtype,
            g.dtype, beta.dtype, None if initial_state is None else initial_state.dtype)


def default_scale(head_dim: int) -> float:
    """``head_dim ** -0.5`` as a Python float: a size ``torch.compile`` made symbolic (automatic dynamic shapes,
    after a model of other sizes) is specialised, so the backend's choice, which reads the scale, stays constant."""
    if not torch.compiler.is_compiling():  # a Python int (dynamo answers type() of a symbolic size with int)
        return head_dim ** -0.5
    return specialised((head_dim,))[0] ** -0.5


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on these inputs."""
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any() over a generator: this runs on every op call
            if t is not None and t.requires_grad:
                return True
    return False


F = TypeVar("F", bound=Callable[..., Any])


def without_autocast(fn: F) -> F:
    """``fn`` run with autocast off on the device of its first tensor argument: a recurrence's pure-torch backend
    computes in the dtypes it chooses (float32 states and products for half inputs), as the kernels do, not in
    the dtype of the caller's ``torch.autocast``."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
        if not torch.is_autocast_enabled(device_type):
            return fn(*args, **kwargs)
        with torch.autocast(device_type, enabled=False):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype recurrent states are kept and accumulated in for inputs of ``dtype``: float64 stays float64,
    everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
