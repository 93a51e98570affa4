"""Boundary-safe forward for Jamba's Mamba-1 mixer: conv through :func:`hybrid_pack.ops.causal_conv1d`,
scan through :func:`hybrid_pack.ops.selective_scan.selective_scan`."""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers.conv import packed_conv
from hybrid_pack.ops.selective_scan import selective_scan

__all__ = ["jamba_mamba_forward"]


def jamba_mamba_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor,
                        boundaries: PackedBoundaries) -> torch.Tensor:
    """``hidden_states [1, T, hidden]`` -> ``[1, T, hidden]``, every document on its own."""
    x, gate = mixer.in_proj(hidden_states).chunk(2, dim=-1)
    x = packed_conv(x, mixer.conv1d, boundaries, mixer.activation)
    dt, B, C = mixer.x_proj(x).split([mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    dt = mixer.dt_proj.weight @ mixer.dt_layernorm(dt).transpose(1, 2)   # [1, D, T], bias added in the scan
    y = selective_scan(x, dt.transpose(1, 2), -torch.exp(mixer.A_log.float()), mixer.b_layernorm(B),
                       mixer.c_layernorm(C), boundaries, D=mixer.D.float(), z=gate,
                       dt_bias=mixer.dt_proj.bias.float())
    return mixer.out_proj(y.to(hidden_states.dtype))
