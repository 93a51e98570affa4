"""Conventions shared by the public ops: packed inputs are ``[1, T, ...]`` matching the boundaries; recurrent
states are float32 (float64 for float64 inputs)."""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError

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


def check_shape(name: str, x: torch.Tensor | None, expected: tuple[int, ...]) -> None:
    """Raise InputError unless ``x`` (when given) has exactly the ``expected`` shape."""
    if x is not None and x.shape != expected:  # torch.Size is a tuple
        raise InputError(f"{name}: expected shape {list(expected)}; got {list(x.shape)}")


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on these inputs."""
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any() over a generator: this runs on every op call
            if t is not None and t.requires_grad:
                return True
    return False


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype recurrent states are kept and accumulated in for inputs of ``dtype``: float64 stays float64,
    everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
