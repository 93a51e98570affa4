"""Gated DeltaNet block (Qwen3-Next's linear-attention layer) on the boundary-safe ops."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.modeling.config import HybridConfig
from hybrid_pack.modeling.norm import GatedRMSNorm
from hybrid_pack.modeling.precision import upcast
from hybrid_pack.ops import causal_conv1d, gated_delta_rule

__all__ = ["GatedDeltaNet"]


class GatedDeltaNet(nn.Module):
    """``in_proj -> short conv (silu) on q, k, v -> gated delta rule -> gated RMSNorm(z) -> out_proj``.

    Per value head: ``beta = sigmoid(b)`` (write strength) and ``g = -exp(A_log) * softplus(a + dt_bias)``
    (log decay, computed in float32). q and k are L2-normalised inside the op. The conv and the
    recurrence both restart at every document start, so nothing flows between documents.

    Parameters: ``in_proj_qkvz`` ``[hidden -> 2 Hk Dk + 2 Hv Dv]`` (q | k | v | z),
    ``in_proj_ba`` ``[hidden -> 2 Hv]`` (b | a), ``conv_weight`` ``[2 Hk Dk + Hv Dv, W]``,
    ``A_log`` / ``dt_bias`` ``[Hv]``, ``norm`` (over ``Dv``, shared by the heads), ``out_proj``.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.num_k_heads = config.gdn_num_k_heads
        self.num_v_heads = config.gdn_num_v_heads
        self.head_k_dim = config.gdn_head_k_dim
        self.head_v_dim = config.gdn_head_v_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = nn.Linear(config.hidden_size, conv_dim + self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(config.hidden_size, 2 * self.num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(conv_dim, config.gdn_conv_width))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, norm_before_gate=True)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """SSM-specific init: decay rates ``A`` uniform in [1, 16], ``dt_bias`` 1, conv like nn.Conv1d."""
        bound = 1.0 / math.sqrt(self.conv_weight.shape[1])
        self.conv_weight.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        self.dt_bias.fill_(1.0)

    def forward(self, hidden_states: torch.Tensor, boundaries: PackedBoundaries) -> torch.Tensor:
        """``[1, T, hidden]`` -> ``[1, T, hidden]``."""
        qkv, z = self.in_proj_qkvz(hidden_states).split([2 * self.key_dim + self.value_dim, self.value_dim], -1)
        b, a = self.in_proj_ba(hidden_states).chunk(2, dim=-1)
        qkv = causal_conv1d(qkv, self.conv_weight, None, boundaries, activation="silu")
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        k = k.unflatten(-1, (self.num_k_heads, self.head_k_dim))
        v = v.unflatten(-1, (self.num_v_heads, self.head_v_dim))
        beta = torch.sigmoid(b)
        g = -upcast(self.A_log).exp() * F.softplus(upcast(a) + upcast(self.dt_bias))
        out, _ = gated_delta_rule(q, k, v, g, beta, boundaries, use_qk_l2norm=True)
        out = self.norm(out, z.unflatten(-1, (self.num_v_heads, self.head_v_dim)))
        return self.out_proj(out.flatten(-2))
