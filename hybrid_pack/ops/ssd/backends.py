"""The SSD scan's backends, highest priority first, and its self-check contract."""

from hybrid_pack.ops.dispatch.backend import FLOAT_DTYPES, KERNEL_DTYPES
from hybrid_pack.ops.dispatch.registry import register, register_op
from hybrid_pack.ops.ssd.check import CONTRACT, OP
from hybrid_pack.ops.ssd.kernel_mamba_ssm import mamba_ssm_device_reason, ssd_accepts
from hybrid_pack.schema import SEQ_IDX

register_op(CONTRACT)
register(OP, "mamba_ssm", "hybrid_pack.ops.ssd.kernel_mamba_ssm:mamba2_ssd", priority=20, devices=("cpu", "cuda"),
         dtypes=KERNEL_DTYPES, boundary_arg=SEQ_IDX, requires=("mamba_ssm", "triton"),
         device_probe=mamba_ssm_device_reason, accepts=ssd_accepts,
         limits="per-document initial states; final states with autograd; chunk_size not a power of two in 16-256")
register(OP, "torch", "hybrid_pack.ops.ssd.torch_backend:mamba2_ssd", priority=0, devices=("cpu", "cuda"),
         dtypes=FLOAT_DTYPES, reference=True, boundary_arg="per-document chunks",
         static="hybrid_pack.ops.ssd.torch_static:mamba2_ssd")
