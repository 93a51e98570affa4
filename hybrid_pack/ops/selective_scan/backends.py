"""The selective scan's backends and its self-check contract.

Pure torch only. mamba-ssm's ``selective_scan_fn`` is a CUDA extension (``selective_scan_cuda``), not a Triton
kernel: it cannot run on CPU (not even under ``TRITON_INTERPRET``), and it takes no ``seq_idx`` / ``cu_seqlens``,
so it scans a packed row as one sequence; no adapter to it is registered.
"""

from hybrid_pack.ops.dispatch.backend import FLOAT_DTYPES
from hybrid_pack.ops.dispatch.registry import register, register_op
from hybrid_pack.ops.selective_scan.check import CONTRACT, OP

register_op(CONTRACT)
register(OP, "torch", "hybrid_pack.ops.selective_scan.torch_backend:selective_scan", priority=0,
         devices=("cpu", "cuda"), dtypes=FLOAT_DTYPES, reference=True,
         boundary_arg="segment starts (state reset)",
         static="hybrid_pack.ops.selective_scan.torch_static:selective_scan")
