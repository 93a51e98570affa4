"""Boundary-safe forward for the gated short convolution of Lfm2 (``y = C * conv(B * x)``)."""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops import causal_conv1d

__all__ = ["short_conv_forward"]


def short_conv_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor,
                       boundaries: PackedBoundaries) -> torch.Tensor:
    """``hidden_states [1, T, hidden]`` -> ``[1, T, hidden]``; the conv taps never cross a document start."""
    b, c, x = mixer.in_proj(hidden_states).chunk(3, dim=-1)
    y = causal_conv1d(b * x, mixer.conv.weight.squeeze(1), mixer.conv.bias, boundaries)
    return mixer.out_proj(c * y)
