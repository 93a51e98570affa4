"""Boundary-safe forward for the Gated DeltaNet mixers of Qwen3-Next, Qwen3.5 (dense and MoE), LaraMini,
Qwen4-Exp and OLMo-Hybrid.

Only the two sequence mixers change: the short convolution over ``q|k|v`` becomes
:func:`hybrid_pack.ops.causal_conv1d` and the chunked delta rule becomes
:func:`hybrid_pack.ops.gated_delta_rule`, both restarting at every document. Projections, gates and
the gated RMSNorm are the module's own (they act token by token). The families differ only there:
how ``q|k|v``, the output gate ``z``, the write strength ``beta`` and the decay input ``a`` are
projected (a ``projections`` function) and the names of the gated norm and output projection (an
``output`` function).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.integrations.transformers.conv import packed_conv
from hybrid_pack.ops import gated_delta_rule

__all__ = ["qwen3_next_projections", "qwen3_5_projections", "olmo_hybrid_projections", "olmo_hybrid_output",
           "gated_deltanet_forward"]

# (qkv before the conv [1, T, 2*H*K + HV*V], z [1, T, HV, V], beta [1, T, HV], a [1, T, HV])
Projections = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def qwen3_next_projections(mixer: torch.nn.Module, hidden_states: torch.Tensor) -> Projections:
    """Qwen3-Next: fused ``in_proj_qkvz`` / ``in_proj_ba`` laid out head group by head group."""
    q, k, v, z, b, a = mixer.fix_query_key_value_ordering(mixer.in_proj_qkvz(hidden_states),
                                                          mixer.in_proj_ba(hidden_states))
    qkv = torch.cat([x.flatten(2) for x in (q, k, v)], dim=-1)
    return qkv, z, b.sigmoid(), a


def qwen3_5_projections(mixer: torch.nn.Module, hidden_states: torch.Tensor) -> Projections:
    """Qwen3.5, Qwen3.5-MoE, LaraMini, Qwen4-Exp: separate ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``."""
    z = mixer.in_proj_z(hidden_states).unflatten(-1, (-1, mixer.head_v_dim))
    return (mixer.in_proj_qkv(hidden_states), z, mixer.in_proj_b(hidden_states).sigmoid(),
            mixer.in_proj_a(hidden_states))


def olmo_hybrid_projections(mixer: torch.nn.Module, hidden_states: torch.Tensor) -> Projections:
    """OLMo-Hybrid: separate ``q_proj``, ``k_proj``, ``v_proj`` (convolved together), ``g_proj`` (the output
    gate), ``b_proj`` and ``a_proj``; with ``allow_neg_eigval`` the write strength is ``2 * sigmoid(b)``."""
    qkv = torch.cat([mixer.q_proj(hidden_states), mixer.k_proj(hidden_states), mixer.v_proj(hidden_states)], dim=-1)
    z = mixer.g_proj(hidden_states).unflatten(-1, (-1, mixer.head_v_dim))
    beta = mixer.b_proj(hidden_states).sigmoid()
    if mixer.allow_neg_eigval:
        beta = beta * 2.0
    return qkv, z, beta, mixer.a_proj(hidden_states)


def _gated_norm_out(norm: torch.nn.Module, out_proj: torch.nn.Module, o: torch.Tensor,
                    z: torch.Tensor) -> torch.Tensor:
    """``o, z [1, T, HV, V]`` -> ``out_proj(norm(o, z)) [1, T, hidden]``; the norm sees one head per row, as the
    families call it."""
    y = norm(o.reshape(-1, o.shape[-1]), z.reshape(-1, z.shape[-1]))
    return out_proj(y.reshape(*o.shape[:2], -1))


def _norm_out_proj(mixer: torch.nn.Module, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return _gated_norm_out(mixer.norm, mixer.out_proj, o, z)


def olmo_hybrid_output(mixer: torch.nn.Module, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """OLMo-Hybrid names its gated norm ``o_norm`` and its output projection ``o_proj``."""
    return _gated_norm_out(mixer.o_norm, mixer.o_proj, o, z)


def gated_deltanet_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor, boundaries: PackedBoundaries,
                           projections: Callable[[torch.nn.Module, torch.Tensor], Projections],
                           output: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
                           = _norm_out_proj) -> torch.Tensor:
    """``hidden_states [1, T, hidden]`` -> ``[1, T, hidden]``, every document on its own.

    ``projections(mixer, hidden_states)`` gives ``(qkv, z, beta, a)`` (see ``Projections``);
    ``output(mixer, o, z)`` maps the delta rule's ``o`` and the gate ``z`` (both ``[1, T, HV, V]``) through the
    gated norm and the output projection to ``[1, T, hidden]``.
    """
    qkv, z, beta, a = projections(mixer, hidden_states)
    qkv = packed_conv(qkv, mixer.conv1d, boundaries, mixer.activation)
    q, k, v = qkv.split([mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
    q, k = (x.unflatten(-1, (-1, mixer.head_k_dim)) for x in (q, k))
    v = v.unflatten(-1, (-1, mixer.head_v_dim))
    g = -mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias)
    o, _ = gated_delta_rule(q, k, v, g, beta, boundaries, use_qk_l2norm=True)
    return output(mixer, o, z)
