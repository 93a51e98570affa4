"""The linear cross-entropy's backends, highest priority first, and its self-check contract."""

from hybrid_pack.ops.dispatch.backend import FLOAT_DTYPES, KERNEL_DTYPES
from hybrid_pack.ops.dispatch.registry import register, register_op
from hybrid_pack.ops.linear_cross_entropy.check import CONTRACT, OP
from hybrid_pack.ops.linear_cross_entropy.kernel_fla import fla_accepts
from hybrid_pack.ops.triton_device import triton_device_reason

register_op(CONTRACT)
register(OP, "fla", "hybrid_pack.ops.linear_cross_entropy.kernel_fla:linear_cross_entropy_sum", priority=20,
         devices=("cpu", "cuda"), dtypes=KERNEL_DTYPES, boundary_arg="none (per-token targets)",
         requires=("fla", "triton"), device_probe=triton_device_reason, accepts=fla_accepts, limits="no tokens")
register(OP, "torch", "hybrid_pack.ops.linear_cross_entropy.torch_backend:linear_cross_entropy_sum", priority=0,
         devices=("cpu", "cuda"), dtypes=FLOAT_DTYPES, reference=True, boundary_arg="none (per-token targets)",
         static="hybrid_pack.ops.linear_cross_entropy.torch_backend:linear_cross_entropy_sum")
