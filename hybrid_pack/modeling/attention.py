"""Softmax attention block: grouped-query attention with RoPE, confined to each document."""

from __future__ import annotations

import torch
from torch import nn

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.modeling.config import HybridConfig
from hybrid_pack.modeling.norm import RMSNorm
from hybrid_pack.modeling.rope import apply_rotary
from hybrid_pack.ops import varlen_attention

__all__ = ["Attention"]


class Attention(nn.Module):
    """Causal GQA over ``varlen_attention``, as in Qwen3-Next (or Bamba with the switches off).

    With ``config.attention_qk_norm`` each query and key head is RMS-normalised before RoPE; with
    ``config.attention_output_gate`` ``q_proj`` also emits a per-channel gate and the attention
    output is multiplied by ``sigmoid(gate)`` before ``o_proj``.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.output_gate = config.attention_output_gate
        q_width = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_width * (2 if self.output_gate else 1), bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.attention_qk_norm else nn.Identity()
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.attention_qk_norm else nn.Identity()

    def forward(self, hidden_states: torch.Tensor, boundaries: PackedBoundaries,
                rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``hidden_states`` ``[1, T, hidden]``, ``rotary`` float32 ``(cos, sin)`` ``[1, T, head_dim]``."""
        q = self.q_proj(hidden_states).unflatten(-1, (self.num_heads, -1))
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
        k = self.k_proj(hidden_states).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden_states).unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, sin = rotary
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        out = varlen_attention(q, k, v, boundaries, causal=True)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.flatten(-2))
