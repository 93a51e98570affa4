"""Boundary-safe forward for the Kimi Delta Attention mixers of Kimi Linear and Bailing-Hybrid (Ling).

Only the two sequence mixers change: the short convolution over ``q|k|v`` becomes
:func:`hybrid_pack.ops.causal_conv1d` and the chunked KDA becomes :func:`hybrid_pack.ops.kda`, both restarting
at every document. Projections, the per-channel forget gate (the module's own ``forget_gate``), ``beta``, the
output gate and the gated RMSNorm are the module's own (they act token by token).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers.conv import packed_conv
from hybrid_pack.ops import kda

__all__ = ["kimi_linear_output_gate", "bailing_hybrid_output_gate", "kda_forward"]


def kimi_linear_output_gate(mixer: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Kimi Linear: the low-rank ``g_b_proj(g_a_proj(x))`` -> ``[1, T, H * K]``."""
    return mixer.g_b_proj(mixer.g_a_proj(hidden_states))


def bailing_hybrid_output_gate(mixer: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Bailing-Hybrid: the full-rank ``g_proj(x)`` -> ``[1, T, H * K]``."""
    return mixer.g_proj(hidden_states)


def kda_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor, boundaries: PackedBoundaries,
                output_gate: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``hidden_states [1, T, hidden]`` -> ``[1, T, hidden]``, every document on its own."""
    qkv = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)], dim=-1)
    qkv = packed_conv(qkv, mixer.conv1d, boundaries, mixer.activation)
    q, k, v = (x.unflatten(-1, (-1, mixer.head_dim)) for x in qkv.split([mixer.qkv_dim] * 3, dim=-1))
    g = mixer.forget_gate(hidden_states)                                             # [1, T, H, K]
    beta = torch.sigmoid(mixer.b_proj(hidden_states))                                # [1, T, H]
    o, _ = kda(q, k, v, g, beta, boundaries, use_qk_l2norm=True)
    gate = output_gate(mixer, hidden_states).unflatten(-1, (-1, mixer.head_dim))
    o = mixer.o_norm(o, gate).flatten(-2)
    return mixer.o_proj(o)
