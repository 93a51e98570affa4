"""mamba-ssm adapter: ``mamba_chunk_scan_combined`` with ``seq_idx``.

``seq_idx`` is what keeps documents apart in this kernel: it zeroes the state passed from one
chunk to the next at a document start and masks the within-chunk terms across documents.
``cu_seqlens`` alone does **not**: the kernel uses it only to read each document's final state
(``return_varlen_states``), so it is passed only for that, always together with ``seq_idx``.

What the kernel cannot do, :func:`ssd_accepts` sends to the next backend:

* ``initial_states``: the kernel takes one initial state per batch row and applies it to the
  first document only; its per-document final states then also ignore it when that document
  ends inside the first chunk.
* final states with autograd: ``return_varlen_states`` has no backward.
* a ``chunk_size`` that is not a power of two in ``[16, 256]``.

mamba-ssm imports its CUDA extension ``selective_scan_cuda`` when the package is imported, though the Triton
SSD never calls it: installed without it (``MAMBA_SKIP_CUDA_BUILD=TRUE``) the package does not import, and
:func:`mamba_ssm_device_reason` says so instead of this backend failing its self-check.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.triton_device import triton_device_reason

__all__ = ["mamba2_ssd", "mamba_ssm_device_reason", "ssd_accepts", "CHUNK_SIZES"]

CHUNK_SIZES = (16, 32, 64, 128, 256)


def _unsupported(*, chunk_size: int, has_initial_states: bool, final_states_with_grad: bool) -> str:
    if chunk_size not in CHUNK_SIZES:
        return f"mamba_chunk_scan_combined takes chunk_size in {CHUNK_SIZES}; got {chunk_size}"
    if has_initial_states:
        return "mamba_chunk_scan_combined takes one initial state per row, not one per document"
    if final_states_with_grad:
        return "mamba_chunk_scan_combined has no backward through per-document final states"
    return ""


@functools.cache
def _import_reason() -> str:
    try:
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401
    except ImportError as err:
        return (f"mamba-ssm does not import ({err}): it needs its CUDA extension built (scripts/install_kernels_gpu.sh "
                "builds it; MAMBA_SKIP_CUDA_BUILD=TRUE leaves it out)")
    return ""


def mamba_ssm_device_reason(device: torch.device, dtype: torch.dtype) -> str:
    """Why ``mamba_chunk_scan_combined`` cannot run on ``device`` with ``dtype`` ("" when it can): where Triton
    kernels run (:func:`~hybrid_pack.ops.triton_device.triton_device_reason`), then whether mamba-ssm imports."""
    return triton_device_reason(device, dtype) or _import_reason()


def ssd_accepts(inputs: Mapping[str, Any]) -> str:
    """"" if ``mamba_chunk_scan_combined`` takes these :func:`~hybrid_pack.ops.mamba2_ssd` inputs, else why not."""
    final_states_with_grad = bool(inputs.get("return_final_states")) and inputs.get("requires_grad", False)
    return _unsupported(chunk_size=inputs["chunk_size"], has_initial_states=inputs.get("initial_states") is not None,
                        final_states_with_grad=final_states_with_grad)


def mamba2_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               boundaries: PackedBoundaries, *, D: torch.Tensor | None, z: torch.Tensor | None,
               dt_bias: torch.Tensor | None, dt_softplus: bool, chunk_size: int,
               initial_states: torch.Tensor | None,
               return_final_states: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`hybrid_pack.ops.mamba2_ssd` through mamba-ssm's ``mamba_chunk_scan_combined(seq_idx=...)``.

    Raises:
        ValueError: inputs :func:`ssd_accepts` refuses (the selector never sends them here).
    """
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    final_states_with_grad = return_final_states and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, dt, A, B, C, D, z, dt_bias))
    why = _unsupported(chunk_size=chunk_size, has_initial_states=initial_states is not None,
                       final_states_with_grad=final_states_with_grad)
    if why:
        raise InputError(f"backend 'mamba_ssm': {why}; use backend='torch'")
    out = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, seq_idx=boundaries.seq_idx,
        cu_seqlens=boundaries.cu_seqlens if return_final_states else None, dt_softplus=dt_softplus,
        return_varlen_states=return_final_states)
    if not return_final_states:
        return out
    y, states = out
    return y, states[: boundaries.num_docs].float()
