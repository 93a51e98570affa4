"""The Mamba-2 SSD scan: the public op, its pure-torch backend, the adapter to mamba-ssm's Triton kernel."""

from hybrid_pack.ops.ssd import backends as _backends  # noqa: F401  (registers the backends)
from hybrid_pack.ops.ssd.op import mamba2_ssd

__all__ = ["mamba2_ssd"]
