"""Depthwise causal conv: the public op, its pure-torch backend, adapters to causal-conv1d and fla."""

from hybrid_pack.ops.conv import backends as _backends  # noqa: F401  (registers the backends)
from hybrid_pack.ops.conv.op import causal_conv1d

__all__ = ["causal_conv1d"]
