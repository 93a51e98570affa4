"""Conventions shared by the public ops: packed inputs are ``[1, T, ...]`` matching the boundaries; recurrent
states are float32 (float64 for float64 inputs)."""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError


def check_packed(name: str, x: torch.Tensor, boundaries: PackedBoundaries | StaticBoundaries, ndim: int) -> None:
    """Raise ValueError unless ``x`` is ``[1, T, ...]`` with ``ndim`` dims and T = boundaries.total_tokens."""
    if not isinstance(boundaries, (PackedBoundaries, StaticBoundaries)):
        raise InputError(f"boundaries: expected a PackedBoundaries (PackedBoundaries.from_batch(batch)); "
                         f"got {type(boundaries).__name__}")
    if x.dim() != ndim:
        raise InputError(f"{name}: expected {ndim} dims [1, T, ...]; got shape {list(x.shape)}")
    if x.shape[0] != 1:
        raise InputError(f"{name}: expected batch size 1 (packed rows are [1, T, ...]; pack the batch with "
                         f"PackingCollator); got shape {list(x.shape)}")
    if x.device != boundaries.device:
        raise InputError(f"boundaries: on {boundaries.device} but {name} is on {x.device}; "
                         f"move them with boundaries.to({name}.device)")
    if x.shape[1] != boundaries.total_tokens:
        raise InputError(f"{name}: expected T = {boundaries.total_tokens} tokens (boundaries.total_tokens); "
                         f"got shape {list(x.shape)}")


def check_shape(name: str, x: torch.Tensor | None, expected: tuple[int, ...]) -> None:
    """Raise ValueError unless ``x`` (when given) has exactly the ``expected`` shape."""
    if x is not None and tuple(x.shape) != tuple(expected):
        raise InputError(f"{name}: expected shape {list(expected)}; got {list(x.shape)}")


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on these inputs."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype recurrent states are kept and accumulated in for inputs of ``dtype``: float64 stays float64,
    everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
