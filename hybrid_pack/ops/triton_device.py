"""Where the Triton kernels (flash-linear-attention, mamba-ssm) can run: on CUDA, and on CPU only in
Triton's interpreter once :func:`hybrid_pack.testing.triton_cpu.enable_cpu_interpreter` has closed the
gaps between those packages and a CPU-only torch (the tests' real-kernel tier)."""

from __future__ import annotations

import os

import torch

__all__ = ["INTERPRET_ENV", "triton_device_reason", "cpu_interpreter_enabled", "mark_cpu_interpreter_ready"]

INTERPRET_ENV = "TRITON_INTERPRET"

_cpu_interpreter_ready = False


def mark_cpu_interpreter_ready() -> None:
    """Record that the CPU interpreter's gaps are closed (called by ``enable_cpu_interpreter``)."""
    global _cpu_interpreter_ready
    _cpu_interpreter_ready = True


def cpu_interpreter_enabled() -> bool:
    """Whether Triton kernels can run on CPU here: the gaps are closed and ``TRITON_INTERPRET=1``."""
    return _cpu_interpreter_ready and os.environ.get(INTERPRET_ENV) == "1"


def triton_device_reason(device: torch.device, dtype: torch.dtype) -> str:
    """Why a Triton kernel cannot run on ``device`` with ``dtype`` ("" when it can)."""
    if device.type != "cpu":
        return ""
    if not cpu_interpreter_enabled():
        return (f"on CPU, Triton kernels run only in the test interpreter ({INTERPRET_ENV}=1, then "
                "hybrid_pack.testing.triton_cpu.enable_cpu_interpreter())")
    if dtype != torch.float32:
        return f"the CPU interpreter path takes float32 only, not {str(dtype).removeprefix('torch.')}"
    return ""
