"""Depthwise causal conv on :class:`StaticBoundaries`: the pure-torch backend's masked taps, traced inline.

The pure-torch backend (:mod:`hybrid_pack.ops.conv.torch_backend`) already reads nothing but
``position_ids``, as a tensor: tap ``i`` of a width-``W`` filter reaches ``r = W - 1 - i`` tokens back and
counts for token ``t`` iff ``position_ids[t] >= r``. Its shapes come from ``x`` and ``weight`` alone and it
branches on no value, so under ``torch.compile`` it traces to one graph per ``(T, D, W)`` whatever the
layout, AOTAutograd derives its backward, and this form shares its arithmetic instead of repeating it.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.ops.conv import torch_backend

__all__ = ["causal_conv1d"]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, boundaries: StaticBoundaries,
                  *, activation: str | None) -> torch.Tensor:
    """Depthwise causal conv whose taps stop at each segment's first token, read from tensors only.

    Args:
        x: ``[1, T, D]``.
        weight: ``[D, W]``; ``weight[:, W - 1]`` multiplies the current token.
        bias: ``[D]`` or None.
        boundaries: the row's static boundaries (only ``position_ids`` is read, as a tensor).
        activation: None or ``"silu"``.

    Returns:
        ``[1, T, D]`` in the dtype of ``x``; accumulated in at least float32.
    """
    return torch_backend.causal_conv1d(x, weight, bias, boundaries, activation=activation)
