"""Boundary-safe forward for the Mamba-2 mixers of Bamba, Nemotron-H, Falcon-H1, GraniteMoeHybrid,
Zamba2 and Mamba2.

All six share one layout: ``in_proj`` gives ``gate | xBC | dt``, a short causal convolution runs
over ``xBC``, the SSD scan over ``x`` with ``B``, ``C`` and ``dt``, then a gated RMSNorm and
``out_proj``. The convolution becomes :func:`hybrid_pack.ops.causal_conv1d` and the scan
:func:`hybrid_pack.ops.mamba2_ssd`, both restarting at every document. Per-family differences are
the input projection (Falcon-H1's muP multipliers) and the output gating (Falcon-H1 without
``mamba_rms_norm`` gates with ``silu`` alone); everything else is read from the module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers.conv import packed_conv
from hybrid_pack.ops import mamba2_ssd

__all__ = ["mamba2_forward", "falcon_h1_in_proj", "falcon_h1_gated_norm"]

NO_DT_LIMIT = (0.0, float("inf"))


def _in_proj(mixer: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return mixer.in_proj(hidden_states)


def _gated_norm(mixer: torch.nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return mixer.norm(y, gate)


def falcon_h1_in_proj(mixer: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Falcon-H1 scales the input by ``ssm_in_multiplier`` and each projected section by its muP multiplier."""
    return mixer.in_proj(hidden_states * mixer.ssm_in_multiplier) * mixer.mup_vector


def falcon_h1_gated_norm(mixer: torch.nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Falcon-H1 uses its gated RMSNorm only with ``mamba_rms_norm``; otherwise ``y * silu(gate)``."""
    return mixer.norm(y, gate) if mixer.mamba_rms_norm else y * F.silu(gate)


def mamba2_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor, boundaries: PackedBoundaries, *,
                   in_proj: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = _in_proj,
                   gated_norm: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = _gated_norm,
                   ) -> torch.Tensor:
    """``hidden_states [1, T, hidden]`` -> ``[1, T, hidden]``, every document on its own."""
    heads, groups, state = mixer.num_heads, mixer.n_groups, mixer.ssm_state_size
    gate, xbc, dt = in_proj(mixer, hidden_states).split([mixer.intermediate_size, mixer.conv_dim, heads], dim=-1)
    xbc = packed_conv(xbc, mixer.conv1d, boundaries, mixer.activation)
    x, B, C = xbc.split([mixer.intermediate_size, groups * state, groups * state], dim=-1)
    dt_bias, dt_softplus = mixer.dt_bias, True
    dt_limit = tuple(mixer.time_step_limit)
    if dt_limit != NO_DT_LIMIT:
        dt = F.softplus(dt + mixer.dt_bias).clamp(*dt_limit)
        dt_bias, dt_softplus = None, False
    y = mamba2_ssd(x.unflatten(-1, (heads, mixer.head_dim)), dt, -torch.exp(mixer.A_log.float()),
                   B.unflatten(-1, (groups, state)), C.unflatten(-1, (groups, state)), boundaries, D=mixer.D,
                   dt_bias=dt_bias, dt_softplus=dt_softplus, chunk_size=mixer.chunk_size)
    y = gated_norm(mixer, y.flatten(2), gate)
    return mixer.out_proj(y.to(hidden_states.dtype))
