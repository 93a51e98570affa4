"""Varlen softmax attention: the public op, its pure-torch backend, adapters to flash-attn, torch's
``varlen_attn`` and flex attention."""

from hybrid_pack.ops.attention import backends as _backends  # noqa: F401  (registers the backends)
from hybrid_pack.ops.attention.op import varlen_attention

__all__ = ["varlen_attention"]
