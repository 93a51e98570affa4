"""Channel mixers: the SwiGLU MLP and a token-wise top-k mixture of experts.

Both act on each token on its own, so packing cannot leak through them. The MoE routes every token
by its own router scores alone: there is no expert capacity, so no token is ever dropped or
re-routed because of other tokens in the batch (other documents included), and there is no
load-balancing loss (a batch statistic, which would tie the gradients of packed documents together).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_pack.modeling.config import HybridConfig
from hybrid_pack.modeling.precision import upcast

__all__ = ["SwiGLU", "MoE", "build_mlp"]


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; ``[..., hidden]`` -> ``[..., hidden]``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k mixture of SwiGLU experts with an optional sigmoid-gated shared expert (Qwen3-Next style).

    ``router`` scores each token; softmax over experts, keep the top ``num_experts_per_tok``
    (renormalised when ``config.norm_topk_prob``); the output is the weighted sum of the chosen
    experts plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``.

    Every expert runs on every token and is weighted by the (mostly zero) routing weights: no
    host sync and no data-dependent shapes, at ``num_experts / num_experts_per_tok`` times the
    FLOPs of a sparse dispatch. Meant for the small expert counts of the presets.
    """

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_expert = None
        self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def routing_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., hidden]`` -> float32 ``[..., num_experts]``, zero outside each token's top k."""
        probs = torch.softmax(upcast(self.router(x)), dim=-1)
        top, index = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(-1, index, top)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.routing_weights(x).to(x.dtype)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + weights[..., e, None] * expert(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def build_mlp(config: HybridConfig) -> nn.Module:
    """The channel mixer of every layer: :class:`MoE` when ``config.num_experts > 0``, else :class:`SwiGLU`."""
    if config.is_moe:
        return MoE(config)
    return SwiGLU(config.hidden_size, config.intermediate_size)
