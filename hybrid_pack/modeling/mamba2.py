"""Mamba-2 block (as in mamba-ssm's ``Mamba2`` and Bamba) on the boundary-safe ops."""

from __future__ import annotations

import math

import torch
from torch import nn

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.modeling.config import HybridConfig
from hybrid_pack.modeling.norm import GatedRMSNorm
from hybrid_pack.modeling.precision import upcast
from hybrid_pack.ops import causal_conv1d, mamba2_ssd

__all__ = ["Mamba2"]

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4


class Mamba2(nn.Module):
    """``in_proj -> z, xBC, dt``; short conv (silu) on ``xBC``; SSD scan; ``norm(y * silu(z))``; ``out_proj``.

    ``A = -exp(A_log)`` per head, ``dt = softplus(dt + dt_bias)`` inside the scan, ``D`` skip per head.
    The gated RMSNorm normalises each of the ``mamba_num_groups`` groups of channels on its own,
    as mamba-ssm does. The conv and the scan restart at every document start.

    Parameters: ``in_proj`` ``[hidden -> 2 I + 2 G N + H]`` with ``I = H P``, ``conv_weight`` /
    ``conv_bias`` over ``I + 2 G N`` channels, ``A_log`` / ``D`` / ``dt_bias`` ``[H]``, ``norm``, ``out_proj``.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.num_groups = config.mamba_num_groups
        self.state_size = config.mamba_state_size
        self.chunk_size = config.mamba_chunk_size
        self.inner_dim = self.num_heads * self.head_dim
        conv_dim = self.inner_dim + 2 * self.num_groups * self.state_size
        self.in_proj = nn.Linear(config.hidden_size, self.inner_dim + conv_dim + self.num_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, config.mamba_conv_width))
        self.conv_bias = nn.Parameter(torch.empty(conv_dim))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedRMSNorm(self.inner_dim, config.rms_norm_eps, group_size=self.inner_dim // self.num_groups,
                                 norm_before_gate=False)
        self.out_proj = nn.Linear(self.inner_dim, config.hidden_size, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """mamba-ssm's init: ``A`` uniform in [1, 16], ``D`` 1, ``softplus(dt_bias)`` log-uniform in [1e-3, 1e-1]."""
        bound = 1.0 / math.sqrt(self.conv_weight.shape[1])
        self.conv_weight.uniform_(-bound, bound)
        self.conv_bias.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        self.D.fill_(1.0)
        log_dt = torch.empty_like(self.dt_bias).uniform_(math.log(DT_MIN), math.log(DT_MAX))
        dt = log_dt.exp().clamp(min=DT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def forward(self, hidden_states: torch.Tensor, boundaries: PackedBoundaries) -> torch.Tensor:
        """``[1, T, hidden]`` -> ``[1, T, hidden]``."""
        group_width = self.num_groups * self.state_size
        z, xbc, dt = self.in_proj(hidden_states).split(
            [self.inner_dim, self.inner_dim + 2 * group_width, self.num_heads], dim=-1)
        xbc = causal_conv1d(xbc, self.conv_weight, self.conv_bias, boundaries, activation="silu")
        x, B, C = xbc.split([self.inner_dim, group_width, group_width], dim=-1)
        y = mamba2_ssd(
            x.unflatten(-1, (self.num_heads, self.head_dim)), dt, -upcast(self.A_log).exp(),
            B.unflatten(-1, (self.num_groups, self.state_size)), C.unflatten(-1, (self.num_groups, self.state_size)),
            boundaries, D=self.D, dt_bias=self.dt_bias, dt_softplus=True, chunk_size=self.chunk_size)
        return self.out_proj(self.norm(y.flatten(-2), z))
