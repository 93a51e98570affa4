"""Boundary-safe forwards of the Mamba-1 mixers (Mamba, FalconMamba, Jamba, Zamba): the conv through
:func:`hybrid_pack.ops.causal_conv1d`, the scan through :func:`hybrid_pack.ops.selective_scan`."""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers.conv import packed_conv
from hybrid_pack.ops.selective_scan import selective_scan

__all__ = ["mamba1_forward", "zamba_mamba_forward"]


def mamba1_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor, boundaries: PackedBoundaries, *,
                   normed: bool = False) -> torch.Tensor:
    """``hidden_states [1, T, hidden]`` -> ``[1, T, hidden]``, every document on its own.

    The layout of Hugging Face's ``MambaMixer``: ``in_proj`` to ``(x, gate)``, the conv on ``x``, ``x_proj`` to
    ``(dt, B, C)``, ``dt_proj`` (its bias added in the scan). ``normed``: ``dt, B, C`` first go through the mixer's
    ``dt_layernorm``, ``b_layernorm`` and ``c_layernorm`` (Jamba; FalconMamba's are weightless RMS norms).
    """
    x, gate = mixer.in_proj(hidden_states).chunk(2, dim=-1)
    x = packed_conv(x, mixer.conv1d, boundaries, mixer.activation)
    dt, B, C = mixer.x_proj(x).split([mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    if normed:
        dt, B, C = mixer.dt_layernorm(dt), mixer.b_layernorm(B), mixer.c_layernorm(C)
    dt = dt @ mixer.dt_proj.weight.T                                     # [1, T, D], bias added in the scan
    bias = mixer.dt_proj.bias
    y = selective_scan(x, dt, -torch.exp(mixer.A_log.float()), B, C, boundaries, D=mixer.D.float(), z=gate,
                       dt_bias=None if bias is None else bias.float())
    return mixer.out_proj(y.to(hidden_states.dtype))


def zamba_mamba_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor,
                        boundaries: PackedBoundaries) -> torch.Tensor:
    """Zamba's ``ZambaMambaMixer``: ``hidden_states [1, T, hidden]`` -> ``[1, T, hidden]``, every document on its own.

    ``in_proj`` interleaves ``x`` and the gate channel by channel; after the conv, the ``D`` channels are split into
    ``n_mamba_heads`` heads, each a Mamba-1 scan with its own ``x_proj``, ``dt_proj``, ``A``, ``D`` and dt bias.
    """
    tokens = hidden_states.shape[1]
    x, gate = mixer.in_proj(hidden_states).view(1, tokens, -1, 2).unbind(-1)
    x = packed_conv(x, mixer.conv1d, boundaries, mixer.activation)
    heads, head_dim = mixer.n_mamba_heads, mixer.mamba_head_dim
    x_heads, gate_heads = x.view(1, tokens, heads, head_dim), gate.view(1, tokens, heads, head_dim)
    bias = mixer.dt_proj_bias
    outputs = []
    for head in range(heads):
        x_head = x_heads[:, :, head]
        dt, B, C = (x_head @ mixer.x_proj_weight[head].T).split(
            [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
        y = selective_scan(x_head, dt @ mixer.dt_proj_weight[head].T, -torch.exp(mixer.A_log[head].float()), B, C,
                           boundaries, D=mixer.D[head].float(), z=gate_heads[:, :, head],
                           dt_bias=None if bias is None else bias[head].float())
        outputs.append(y)
    return mixer.out_proj(torch.cat(outputs, dim=-1).to(hidden_states.dtype))
