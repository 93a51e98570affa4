"""Kimi Delta Attention's backends, highest priority first, and its self-check contract."""

from hybrid_pack.ops.dispatch.backend import FLOAT_DTYPES, KERNEL_DTYPES
from hybrid_pack.ops.dispatch.registry import register, register_op
from hybrid_pack.ops.kda.check import CONTRACT, OP
from hybrid_pack.ops.kda.kernel_fla import kda_accepts
from hybrid_pack.ops.triton_device import triton_device_reason

register_op(CONTRACT)
register(OP, "fla", "hybrid_pack.ops.kda.kernel_fla:kda", priority=20, devices=("cpu", "cuda"),
         dtypes=KERNEL_DTYPES, boundary_arg="cu_seqlens", requires=("fla", "triton"),
         device_probe=triton_device_reason, accepts=kda_accepts, limits="key head dim > 256")
register(OP, "torch", "hybrid_pack.ops.kda.torch_backend:kda", priority=0, devices=("cpu", "cuda"),
         dtypes=FLOAT_DTYPES, reference=True, boundary_arg="per-document chunks")
