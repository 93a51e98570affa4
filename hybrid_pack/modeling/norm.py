"""RMSNorm and the gated RMSNorm that closes Gated DeltaNet and Mamba-2 blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pack.errors import InputError
from hybrid_pack.modeling.precision import upcast

__all__ = ["RMSNorm", "GatedRMSNorm"]


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dim, in float32."""
    x = upcast(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dim; statistics in float32, output in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_normalize(x, self.eps) * upcast(self.weight)).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm gated by ``silu(z)``, normalising groups of ``group_size`` channels on their own.

    ``norm_before_gate=True`` gives ``norm(x) * silu(z)`` (Qwen3-Next's Gated DeltaNet);
    ``False`` gives ``norm(x * silu(z))`` (mamba-ssm's Mamba-2, Bamba).

    Args:
        dim: channels of ``x`` and ``z`` (the last dim).
        group_size: channels per normalisation group (``dim`` by default; must divide it).
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, group_size: int | None = None,
                 norm_before_gate: bool = True) -> None:
        super().__init__()
        group_size = dim if group_size is None else group_size
        if dim % group_size:
            raise InputError(f"group_size: expected a divisor of dim={dim}; got {group_size}")
        self.eps = eps
        self.group_size = group_size
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``x``, ``z``: ``[..., dim]`` -> ``[..., dim]`` in x's dtype."""
        gate = F.silu(upcast(z))
        h = upcast(x) if self.norm_before_gate else upcast(x) * gate
        groups = h.unflatten(-1, (-1, self.group_size))
        h = _rms_normalize(groups, self.eps).flatten(-2)
        if self.norm_before_gate:
            h = h * gate
        return (h * upcast(self.weight)).to(x.dtype)
