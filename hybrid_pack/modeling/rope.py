"""Rotary position embedding driven by restarting ``position_ids``.

In a packed row the positions restart at 0 at every document, so each document is rotated exactly
as it would be alone: RoPE needs no other boundary information.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_pack.modeling.precision import upcast

__all__ = ["RotaryEmbedding", "apply_rotary"]


class RotaryEmbedding(nn.Module):
    """``cos`` / ``sin`` tables for positions, half-split (``rotate_half``) layout.

    Args:
        head_dim: the rotated size (even).
        theta: the frequency base.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        self.register_buffer("inv_freq", (1.0 / theta ** exponents).float(), persistent=False)

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[1, T]`` -> float32 ``(cos, sin)``, each ``[1, T, head_dim]``."""
        freqs = position_ids.float()[..., None] * self.inv_freq.to(position_ids.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[1, T, H, D]`` by float32 ``cos`` / ``sin`` ``[1, T, D]``; returns x's dtype."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = upcast(x)
    return (xf * cos.to(xf.dtype) + _rotate_half(xf) * sin.to(xf.dtype)).to(x.dtype)
