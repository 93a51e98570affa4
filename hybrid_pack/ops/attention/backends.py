"""The attention op's backends, highest priority first, and its self-check contract."""

import torch

from hybrid_pack.ops.attention.check import CONTRACT, OP
from hybrid_pack.ops.attention.kernel_flash_attn import flash_attn_accepts
from hybrid_pack.ops.attention.kernel_torch_varlen import varlen_attn_probe
from hybrid_pack.ops.dispatch.backend import FLOAT_DTYPES, KERNEL_DTYPES
from hybrid_pack.ops.dispatch.registry import register, register_op

HALF = (torch.float16, torch.bfloat16)

register_op(CONTRACT)
register(OP, "flash_attn", "hybrid_pack.ops.attention.kernel_flash_attn:varlen_attention", priority=30, dtypes=HALF,
         boundary_arg="cu_seqlens", requires=("flash_attn", "flash_attn_2_cuda"), accepts=flash_attn_accepts,
         limits="head dim > 256")
register(OP, "torch_varlen", "hybrid_pack.ops.attention.kernel_torch_varlen:varlen_attention", priority=20,
         dtypes=HALF, boundary_arg="cu_seqlens", probe=varlen_attn_probe, accepts=flash_attn_accepts,
         limits="head dim > 256")
register(OP, "flex", "hybrid_pack.ops.attention.kernel_flex:varlen_attention", priority=10, dtypes=KERNEL_DTYPES,
         boundary_arg="seq_idx block mask")
register(OP, "torch", "hybrid_pack.ops.attention.torch_backend:varlen_attention", priority=0,
         devices=("cpu", "cuda"), dtypes=FLOAT_DTYPES, reference=True, boundary_arg="per-document blocks",
         static="hybrid_pack.ops.attention.torch_static:varlen_attention")
