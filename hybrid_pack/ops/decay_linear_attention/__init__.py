"""Decay linear attention (MiniMax's lightning attention, fla's simple GLA): the public op, its pure-torch backend,
its static form, its context-parallel path and the adapter to fla's chunked kernel."""

from hybrid_pack.ops.decay_linear_attention import backends as _backends  # noqa: F401  (registers the backends)
from hybrid_pack.ops.decay_linear_attention.op import decay_linear_attention

__all__ = ["decay_linear_attention"]
