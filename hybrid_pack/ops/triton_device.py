"""Where the Triton kernels (flash-linear-attention, mamba-ssm) can run: on CUDA, and on CPU only in Triton's
interpreter (``TRITON_INTERPRET=1``) once the process has closed the gaps between those packages and a CPU-only
torch and said so with :func:`mark_cpu_interpreter_ready`. This repository's real-kernel tests do that
(``tests/kernels/triton_cpu.py``); nothing in hybrid_pack patches Triton or the kernel packages."""

from __future__ import annotations

import os

import torch

__all__ = ["INTERPRET_ENV", "triton_device_reason", "cpu_interpreter_enabled", "mark_cpu_interpreter_ready"]

INTERPRET_ENV = "TRITON_INTERPRET"

_cpu_interpreter_ready = False


def mark_cpu_interpreter_ready() -> None:
    """Let float32 Triton kernels run on CPU under ``TRITON_INTERPRET=1``: for a process that made the kernel
    packages run in Triton's interpreter (``tests/kernels/triton_cpu.py`` does, then calls this)."""
    global _cpu_interpreter_ready
    _cpu_interpreter_ready = True


def cpu_interpreter_enabled() -> bool:
    """Whether Triton kernels can run on CPU here: :func:`mark_cpu_interpreter_ready` was called and
    ``TRITON_INTERPRET=1``."""
    return _cpu_interpreter_ready and os.environ.get(INTERPRET_ENV) == "1"


def triton_device_reason(device: torch.device, dtype: torch.dtype) -> str:
    """Why a Triton kernel cannot run on ``device`` with ``dtype`` ("" when it can)."""
    if device.type != "cpu":
        return ""
    if not cpu_interpreter_enabled():
        return (f"on CPU, Triton kernels run only in the kernel tests' interpreter ({INTERPRET_ENV}=1 and "
                "tests/kernels/triton_cpu.py)")
    if dtype != torch.float32:
        return f"the CPU interpreter path takes float32 only, not {str(dtype).removeprefix('torch.')}"
    return ""
