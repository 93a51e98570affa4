"""flash-linear-attention adapters: ``chunk_gated_delta_rule`` and the Triton ``causal_conv1d``.

Both kernels keep documents apart through ``cu_seqlens`` (one state per segment, reset at each
start). The host-side index they would otherwise derive from it on the device with a sync,
``chunk_indices`` (every ``(segment, chunk)`` pair) and ``cu_seqlens_cpu``, is built here from
the Python ints of :class:`~hybrid_pack.PackedBoundaries`, once per segment layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["gated_delta_rule", "causal_conv1d", "gated_delta_accepts", "KERNEL_CHUNK_SIZE", "MAX_HEAD_DIM"]

KERNEL_CHUNK_SIZE = 64  # the chunk length both fla kernels use by default
MAX_HEAD_DIM = 256  # chunk_delta_h holds the K dimension of the state in at most four 64-wide blocks


@lru_cache(maxsize=64)
def _chunk_index(segment_lengths: tuple[int, ...], chunk_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chunk_indices [num_chunks, 2] int32 on device, cu_seqlens_cpu [S+1] int64)`` for fla."""
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    chunks = -(-lengths // chunk_size)
    segment = np.repeat(np.arange(lengths.size, dtype=np.int64), chunks)
    first_chunk = np.repeat(np.cumsum(chunks) - chunks, chunks)
    within = np.arange(segment.size, dtype=np.int64) - first_chunk
    chunk_indices = torch.from_numpy(np.stack([segment, within], 1).astype(np.int32)).to(device)
    cu_seqlens_cpu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    return chunk_indices, cu_seqlens_cpu


def chunk_index(boundaries: PackedBoundaries) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached ``(chunk_indices, cu_seqlens_cpu)`` of ``boundaries`` for fla's 64-token chunks."""
    return _chunk_index(boundaries.segment_lengths, KERNEL_CHUNK_SIZE, boundaries.device)


def gated_delta_accepts(inputs: Mapping[str, Any]) -> str:
    """"" if ``chunk_gated_delta_rule`` takes these inputs, else why not."""
    head_dim = inputs["q"].shape[-1]
    if head_dim > MAX_HEAD_DIM:
        return f"fla's chunk_gated_delta_rule takes key head dims up to {MAX_HEAD_DIM}; got {head_dim}"
    return ""


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     boundaries: PackedBoundaries, *, scale: float, initial_state: torch.Tensor | None,
                     output_final_state: bool, use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`hybrid_pack.ops.gated_delta_rule` through fla's ``chunk_gated_delta_rule(cu_seqlens=...)``.

    fla keeps one state per ``cu_seqlens`` segment, the padding segment included: it starts from
    zero here and its final state is dropped.
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    chunk_indices, cu_seqlens_cpu = chunk_index(boundaries)
    num_pad_segments = boundaries.num_segments - boundaries.num_docs
    if initial_state is not None and num_pad_segments:
        initial_state = torch.cat([initial_state, initial_state.new_zeros(num_pad_segments, *initial_state.shape[1:])])
    o, final_state = chunk_gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=boundaries.cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        chunk_indices=chunk_indices)
    if final_state is not None:
        final_state = final_state[: boundaries.num_docs]
    return o, final_state


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, boundaries: PackedBoundaries,
                  *, activation: str | None) -> torch.Tensor:
    """:func:`hybrid_pack.ops.causal_conv1d` through fla's Triton ``causal_conv1d(cu_seqlens=...)``."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d

    chunk_indices, cu_seqlens_cpu = chunk_index(boundaries)
    y, _ = fla_causal_conv1d(x, weight, bias, activation=activation, backend="triton",
                             cu_seqlens=boundaries.cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                             chunk_indices=chunk_indices)
    return y
