"""The gated delta rule's backends, highest priority first, and its self-check contract."""

from hybrid_pack.ops.dispatch.backend import FLOAT_DTYPES, KERNEL_DTYPES
from hybrid_pack.ops.dispatch.registry import register, register_op
from hybrid_pack.ops.fla_cp import FLA_CP
from hybrid_pack.ops.gated_delta.check import CONTRACT, OP
from hybrid_pack.ops.gated_delta.kernel_fla import gated_delta_accepts
from hybrid_pack.ops.gated_delta.kernel_fla_cp import device_probe, fla_cp_accepts
from hybrid_pack.ops.triton_device import triton_device_reason

register_op(CONTRACT)
register(OP, "fla", "hybrid_pack.ops.gated_delta.kernel_fla:gated_delta_rule", priority=20, devices=("cpu", "cuda"),
         dtypes=KERNEL_DTYPES, boundary_arg="cu_seqlens", requires=("fla", "triton"),
         device_probe=triton_device_reason, accepts=gated_delta_accepts, limits="key head dim > 256")
register(OP, FLA_CP, "hybrid_pack.ops.gated_delta.kernel_fla_cp:gated_delta_rule_fla_cp", priority=10,
         sharded=True, dtypes=KERNEL_DTYPES, boundary_arg="ShardedBoundaries (fla cp_context)", requires=("fla",),
         device_probe=device_probe, accepts=fla_cp_accepts,
         limits="not NCCL; layout not contiguous; states; key head dim > 256; capability < 8.0")
register(OP, "torch", "hybrid_pack.ops.gated_delta.torch_backend:gated_delta_rule", priority=0,
         devices=("cpu", "cuda"), dtypes=FLOAT_DTYPES, reference=True, boundary_arg="per-document chunks",
         static="hybrid_pack.ops.gated_delta.torch_static:gated_delta_rule")
