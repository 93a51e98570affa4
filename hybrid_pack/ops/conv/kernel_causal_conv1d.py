"""causal-conv1d adapter: ``causal_conv1d_fn`` with int32 ``seq_idx``.

``seq_idx`` is what keeps documents apart here: without it the kernel convolves straight across
document starts. The kernel honours ``seq_idx`` only in the channels-last layout, so the packed
``[1, T, D]`` row is handed over as ``x.transpose(1, 2)`` (``[1, D, T]`` with ``stride(1) == 1``).
That layout takes filter widths 2..4 and channel counts that are multiples of 8; other inputs go
to the next backend (:func:`conv_accepts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["causal_conv1d", "conv_accepts", "WIDTHS", "CHANNEL_MULTIPLE"]

WIDTHS = (2, 3, 4)
CHANNEL_MULTIPLE = 8


def conv_accepts(inputs: Mapping[str, Any]) -> str:
    """"" if channels-last ``causal_conv1d_fn`` takes these conv inputs, else why not."""
    channels, width = inputs["weight"].shape
    if width not in WIDTHS:
        return f"causal_conv1d_fn with seq_idx takes widths {WIDTHS}; got {width}"
    if channels % CHANNEL_MULTIPLE:
        return f"causal_conv1d_fn with seq_idx takes channel counts divisible by {CHANNEL_MULTIPLE}; got {channels}"
    return ""


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, boundaries: PackedBoundaries,
                  *, activation: str | None) -> torch.Tensor:
    """:func:`hybrid_pack.ops.causal_conv1d` through ``causal_conv1d_fn(x.transpose(1, 2), seq_idx=...)``."""
    from causal_conv1d import causal_conv1d_fn

    channels_last = x.contiguous().transpose(1, 2)
    y = causal_conv1d_fn(channels_last, weight, bias, seq_idx=boundaries.seq_idx, activation=activation)
    return y.transpose(1, 2)
