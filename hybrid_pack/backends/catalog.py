"""Every backend hybrid_pack knows, with how each keeps documents apart.

The pure-torch backends (priority 0) run everywhere and are the oracles; kernel adapters rank
above them where their packages, devices and dtypes allow. Each adapter hands its kernel the one
boundary argument that kernel honours (see docs/backends.md); inputs a kernel cannot take with
boundaries go to the next backend through ``accepts``. On CPU the Triton kernels (fla, mamba-ssm)
run only in Triton's interpreter, for tests (:mod:`hybrid_pack.ops.kernels.triton_cpu`).
"""

import torch

from hybrid_pack.backends.registry import Backend, register
from hybrid_pack.ops.kernels.causal_conv1d import conv_accepts
from hybrid_pack.ops.kernels.fla import gated_delta_accepts
from hybrid_pack.ops.kernels.flash_attn import flash_attn_accepts
from hybrid_pack.ops.kernels.mamba_ssm import ssd_accepts
from hybrid_pack.ops.kernels.torch_varlen import varlen_attn_probe
from hybrid_pack.ops.kernels.triton_cpu import triton_device_reason

HALF = (torch.float16, torch.bfloat16)
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

register(Backend(op="attention", name="torch", impl="hybrid_pack.ops.torch.attention:varlen_attention",
                 boundary_arg="per-document blocks", priority=0))
register(Backend(op="attention", name="flash_attn", impl="hybrid_pack.ops.kernels.flash_attn:varlen_attention",
                 boundary_arg="cu_seqlens", priority=30, requires=("flash_attn", "flash_attn_2_cuda"),
                 devices=("cuda",), dtypes=HALF, accepts=flash_attn_accepts))
register(Backend(op="attention", name="torch_varlen", impl="hybrid_pack.ops.kernels.torch_varlen:varlen_attention",
                 boundary_arg="cu_seqlens", priority=20, devices=("cuda",), dtypes=HALF,
                 probe=varlen_attn_probe, accepts=flash_attn_accepts))
register(Backend(op="attention", name="flex", impl="hybrid_pack.ops.kernels.flex:varlen_attention",
                 boundary_arg="seq_idx block mask", priority=10, devices=("cuda",), dtypes=TRITON_DTYPES))

register(Backend(op="conv", name="torch", impl="hybrid_pack.ops.torch.conv:causal_conv1d",
                 boundary_arg="seq_idx tap mask", priority=0))
register(Backend(op="conv", name="causal_conv1d", impl="hybrid_pack.ops.kernels.causal_conv1d:causal_conv1d",
                 boundary_arg="seq_idx", priority=30, requires=("causal_conv1d", "causal_conv1d_cuda"),
                 devices=("cuda",), dtypes=TRITON_DTYPES, accepts=conv_accepts))
register(Backend(op="conv", name="fla", impl="hybrid_pack.ops.kernels.fla:causal_conv1d",
                 boundary_arg="cu_seqlens", priority=20, requires=("fla", "triton"),
                 dtypes=TRITON_DTYPES, device_probe=triton_device_reason))

register(Backend(op="gated_delta", name="torch", impl="hybrid_pack.ops.torch.gated_delta:gated_delta_rule",
                 boundary_arg="per-document chunks", priority=0))
register(Backend(op="gated_delta", name="fla", impl="hybrid_pack.ops.kernels.fla:gated_delta_rule",
                 boundary_arg="cu_seqlens", priority=20, requires=("fla", "triton"),
                 dtypes=TRITON_DTYPES, device_probe=triton_device_reason, accepts=gated_delta_accepts))

register(Backend(op="ssd", name="torch", impl="hybrid_pack.ops.torch.ssd:mamba2_ssd",
                 boundary_arg="per-document chunks", priority=0))
register(Backend(op="ssd", name="mamba_ssm", impl="hybrid_pack.ops.kernels.mamba_ssm:mamba2_ssd",
                 boundary_arg="seq_idx", priority=20, requires=("mamba_ssm", "triton"),
                 dtypes=TRITON_DTYPES, device_probe=triton_device_reason, accepts=ssd_accepts))
