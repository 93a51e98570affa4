"""Boundary-safe forward for the Gated DeltaNet mixers of Qwen3-Next and Qwen3.5.

Only the two sequence mixers change: the short convolution over ``q|k|v`` becomes
:func:`hybrid_pack.ops.causal_conv1d` and the chunked delta rule becomes
:func:`hybrid_pack.ops.gated_delta_rule`, both restarting at every document. Projections, gates and
the gated RMSNorm are the module's own (they act token by token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers.conv import packed_conv
from hybrid_pack.ops import gated_delta_rule

__all__ = ["qwen3_next_projections", "qwen3_5_projections", "gated_deltanet_forward"]

# (qkv before the conv [1, T, 2*H*K + HV*V], z [1, T, HV, V], b [1, T, HV], a [1, T, HV])
Projections = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def qwen3_next_projections(mixer: torch.nn.Module, hidden_states: torch.Tensor) -> Projections:
    """Qwen3-Next: fused ``in_proj_qkvz`` / ``in_proj_ba`` laid out head group by head group."""
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(hidden_states),
                                                          mixer.in_proj_ba(hidden_states))
    qkv = torch.cat([x.flatten(2) for x in (q, k, v)], dim=-1)
    return qkv, z, b, a


def qwen3_5_projections(mixer: torch.nn.Module, hidden_states: torch.Tensor) -> Projections:
    """Qwen3.5: separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``."""
    z = mixer.in_proj_z(hidden_states).unflatten(-1, (-1, mixer.head_v_dim))
    return mixer.in_proj_qkv(hidden_states), z, mixer.in_proj_b(hidden_states), mixer.in_proj_a(hidden_states)


def gated_deltanet_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor, boundaries: PackedBoundaries,
                           projections: Callable[[torch.nn.Module, torch.Tensor], Projections]) -> torch.Tensor:
    """``hidden_states [1, T, hidden]`` -> ``[1, T, hidden]``, every document on its own."""
    qkv, z, b, a = projections(mixer, hidden_states)
    qkv = packed_conv(qkv, mixer.conv1d, boundaries, mixer.activation)
    q, k, v = qkv.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q, k = (x.unflatten(-1, (-1, mixer.head_k_dim)) for x in (q, k))
    v = v.unflatten(-1, (-1, mixer.head_v_dim))
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    o, _ = gated_delta_rule(q, k, v, g, b.sigmoid(), boundaries, use_qk_l2norm=True)
    o = mixer.norm(o.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
    return mixer.out_proj(o.reshape(*hidden_states.shape[:-1], -1))
