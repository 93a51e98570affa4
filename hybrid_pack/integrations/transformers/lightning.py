"""Boundary-safe forward for MiniMax's lightning attention layers (``MiniMaxLightningAttention``).

The layer is decay linear attention: ``q|k|v = act(qkv_proj(x))`` per head, the state
``S_t = e^{-s_h} S_{t-1} + k_t v_t^T`` with one fixed slope ``s_h`` per head (``mixer.slope_rate``, which
MiniMax sets per layer), ``o_t = S_t^T q_t`` (no scale), then an RMSNorm over all heads, a sigmoid output gate
on ``x`` and ``out_proj``. The module computes the recurrence block by block; here it is
:func:`hybrid_pack.ops.decay_linear_attention`, restarting at every document. Projections, norm and gate are the
module's own (they act token by token).
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops import decay_linear_attention

__all__ = ["lightning_attention_forward"]


def lightning_attention_forward(mixer: torch.nn.Module, hidden_states: torch.Tensor,
                                boundaries: PackedBoundaries) -> tuple[torch.Tensor, None]:
    """``hidden_states [1, T, hidden]`` -> ``([1, T, hidden], None)``, every document on its own.

    A pair, as the module's own forward returns (its decoder layer unpacks two values); the second, the module's
    last recurrent state, is None on a packed row (there is one per document, and packed calls keep no cache).
    """
    heads, head_dim = mixer.num_attention_heads, mixer.head_dim
    qkv = mixer.act_fn(mixer.qkv_proj(hidden_states)).unflatten(-1, (heads, 3 * head_dim))
    q, k, v = qkv.split(head_dim, dim=-1)
    log_decay = -mixer.slope_rate.float().reshape(heads)
    o, _ = decay_linear_attention(q, k, v, log_decay, boundaries, scale=1.0)
    o = mixer.norm(o.flatten(2))
    o = torch.sigmoid(mixer.output_gate(hidden_states)) * o
    return mixer.out_proj(o), None
