"""The gated delta rule: the public op, its pure-torch backend, the adapter to fla's chunked kernel."""

from hybrid_pack.ops.gated_delta import backends as _backends  # noqa: F401  (registers the backends)
from hybrid_pack.ops.gated_delta.op import gated_delta_rule

__all__ = ["gated_delta_rule"]
