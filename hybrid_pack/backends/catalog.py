"""Every backend hybrid_pack knows, with how each keeps documents apart.

The pure-torch backends (priority 0) run everywhere and are the oracles; kernel adapters rank
above them where their packages, devices and dtypes allow.
"""

from hybrid_pack.backends.registry import Backend, register

register(Backend(op="attention", name="torch", impl="hybrid_pack.ops.torch.attention:varlen_attention",
                 boundary_arg="per-document blocks", priority=0))
register(Backend(op="conv", name="torch", impl="hybrid_pack.ops.torch.conv:causal_conv1d",
                 boundary_arg="seq_idx tap mask", priority=0))
register(Backend(op="gated_delta", name="torch", impl="hybrid_pack.ops.torch.gated_delta:gated_delta_rule",
                 boundary_arg="per-document chunks", priority=0))
register(Backend(op="ssd", name="torch", impl="hybrid_pack.ops.torch.ssd:mamba2_ssd",
                 boundary_arg="per-document chunks", priority=0))
