"""Decay linear attention's backends, highest priority first, and its self-check contract."""

from hybrid_pack.ops.decay_linear_attention.check import CONTRACT, OP
from hybrid_pack.ops.dispatch.backend import FLOAT_DTYPES, KERNEL_DTYPES
from hybrid_pack.ops.dispatch.registry import register, register_op
from hybrid_pack.ops.triton_device import triton_device_reason

register_op(CONTRACT)
register(OP, "fla", "hybrid_pack.ops.decay_linear_attention.kernel_fla:decay_linear_attention", priority=20,
         devices=("cpu", "cuda"), dtypes=KERNEL_DTYPES, boundary_arg="cu_seqlens", requires=("fla", "triton"),
         device_probe=triton_device_reason)
register(OP, "torch", "hybrid_pack.ops.decay_linear_attention.torch_backend:decay_linear_attention", priority=0,
         devices=("cpu", "cuda"), dtypes=FLOAT_DTYPES, reference=True, boundary_arg="per-document chunks",
         static="hybrid_pack.ops.decay_linear_attention.torch_static:decay_linear_attention")
