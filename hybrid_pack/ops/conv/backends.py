"""The conv op's backends, highest priority first, and its self-check contract.

Each kernel adapter hands its kernel the one boundary argument that kernel honours; inputs a kernel
cannot take with boundaries go to the next backend through ``accepts``.
"""

from hybrid_pack.ops.conv.check import CONTRACT, OP
from hybrid_pack.ops.conv.kernel_causal_conv1d import conv_accepts
from hybrid_pack.ops.conv.kernel_fla_cp import device_probe, fla_cp_accepts
from hybrid_pack.ops.dispatch.backend import FLOAT_DTYPES, KERNEL_DTYPES
from hybrid_pack.ops.dispatch.registry import register, register_op
from hybrid_pack.ops.fla_cp import FLA_CP
from hybrid_pack.ops.triton_device import triton_device_reason
from hybrid_pack.schema import SEQ_IDX

register_op(CONTRACT)
register(OP, "causal_conv1d", "hybrid_pack.ops.conv.kernel_causal_conv1d:causal_conv1d", priority=30,
         boundary_arg=SEQ_IDX, requires=("causal_conv1d", "causal_conv1d_cuda"), accepts=conv_accepts,
         limits="width not in 2-4; channels not a multiple of 8")
register(OP, "fla", "hybrid_pack.ops.conv.kernel_fla:causal_conv1d", priority=20, devices=("cpu", "cuda"),
         dtypes=KERNEL_DTYPES, boundary_arg="cu_seqlens", requires=("fla", "triton"),
         device_probe=triton_device_reason)
register(OP, FLA_CP, "hybrid_pack.ops.conv.kernel_fla_cp:causal_conv1d_fla_cp", priority=10, sharded=True,
         dtypes=KERNEL_DTYPES, boundary_arg="ShardedBoundaries (fla cp_context)", requires=("fla",),
         device_probe=device_probe, accepts=fla_cp_accepts, limits="not NCCL; layout not contiguous")
register(OP, "torch", "hybrid_pack.ops.conv.torch_backend:causal_conv1d", priority=0, devices=("cpu", "cuda"),
         dtypes=FLOAT_DTYPES, reference=True, boundary_arg="seq_idx tap mask",
         static="hybrid_pack.ops.conv.torch_static:causal_conv1d")
