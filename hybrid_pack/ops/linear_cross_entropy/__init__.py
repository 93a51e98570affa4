"""Linear cross-entropy: the loss of an LM head without its ``[T, V]`` logits; the public op, its chunked
pure-torch backend, the adapter to fla's fused kernel."""

from hybrid_pack.ops.linear_cross_entropy import backends as _backends  # noqa: F401  (registers the backends)
from hybrid_pack.ops.linear_cross_entropy.op import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
