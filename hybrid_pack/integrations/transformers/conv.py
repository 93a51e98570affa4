"""The short causal convolution of every patched mixer, with the family's own activation.

The conv kernels of :func:`hybrid_pack.ops.causal_conv1d` fuse ``silu`` only; any other activation a
family accepts (``gelu``, ``relu``, ...) is applied after the kernel with transformers' own ``ACT2FN``,
exactly as the family's code applies it to its convolution's output.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops import causal_conv1d

__all__ = ["packed_conv"]

_FUSED = ("silu", "swish")


def packed_conv(x: torch.Tensor, conv: torch.nn.Conv1d, boundaries: PackedBoundaries,
                activation: str | None) -> torch.Tensor:
    """``x [1, T, C]`` through the depthwise ``conv`` (weights ``[C, 1, W]``) then ``activation`` -> ``[1, T, C]``."""
    fused = activation if activation in _FUSED else None
    out = causal_conv1d(x, conv.weight.squeeze(1), conv.bias, boundaries, activation=fused)
    if activation is None or fused is not None:
        return out
    from transformers.activations import ACT2FN

    return ACT2FN[activation](out)
