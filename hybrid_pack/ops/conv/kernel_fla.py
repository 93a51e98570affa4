"""flash-linear-attention adapter: the Triton ``causal_conv1d`` with ``cu_seqlens``.

``cu_seqlens`` keeps documents apart: the conv window restarts at every segment. The host index
fla would otherwise derive from it on the device with a sync (``chunk_indices`` and
``cu_seqlens_cpu``) comes from :meth:`PackedBoundaries.kernel_chunk_index`, built once per row.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["causal_conv1d", "KERNEL_CHUNK_SIZE"]

KERNEL_CHUNK_SIZE = 64  # the block length of fla's varlen index


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, boundaries: PackedBoundaries,
                  *, activation: str | None) -> torch.Tensor:
    """:func:`hybrid_pack.ops.causal_conv1d` through fla's Triton ``causal_conv1d(cu_seqlens=...)``."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

    chunk_indices, cu_seqlens_cpu = boundaries.kernel_chunk_index(KERNEL_CHUNK_SIZE)
    y, _ = fla_causal_conv1d(x, weight, bias, activation=activation, backend="triton",
                             cu_seqlens=boundaries.cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                             chunk_indices=chunk_indices)
    return y
