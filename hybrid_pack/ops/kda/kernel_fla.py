"""flash-linear-attention adapter: ``chunk_kda`` with ``cu_seqlens``.

``cu_seqlens`` keeps documents apart: one state per segment, reset at each start. The host copy of the
boundaries fla would otherwise read back from the device (``cu_seqlens_cpu``) comes from
:meth:`PackedBoundaries.kernel_chunk_index`, built once per row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["kda", "kda_accepts", "KERNEL_CHUNK_SIZE", "MAX_HEAD_DIM"]

KERNEL_CHUNK_SIZE = 64  # the chunk length of chunk_kda
MAX_HEAD_DIM = 256  # chunk_kda's limit on the key head dim


def kda_accepts(inputs: Mapping[str, Any]) -> str:
    """"" if ``chunk_kda`` takes these inputs, else why not."""
    head_dim = inputs["q"].shape[-1]
    if head_dim > MAX_HEAD_DIM:
        return f"fla's chunk_kda takes key head dims up to {MAX_HEAD_DIM}; got {head_dim}"
    return ""


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        boundaries: PackedBoundaries, *, scale: float, initial_state: torch.Tensor | None, output_final_state: bool,
        use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`hybrid_pack.ops.kda.kda` through fla's ``chunk_kda(cu_seqlens=...)`` (the gate precomputed:
    ``use_gate_in_kernel=False``).

    fla keeps one float32 state per ``cu_seqlens`` segment, the padding segment included: it starts from zero
    here and its final state is dropped.
    """
    from fla.ops.kda import chunk_kda

    _, cu_seqlens_cpu = boundaries.kernel_chunk_index(KERNEL_CHUNK_SIZE)
    if initial_state is not None:
        num_pad_segments = boundaries.num_segments - boundaries.num_docs
        initial_state = torch.cat([initial_state.float(),
                                   initial_state.new_zeros(num_pad_segments, *initial_state.shape[1:]).float()])
    o, final_state = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm,
                               cu_seqlens=boundaries.cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                               chunk_size=KERNEL_CHUNK_SIZE)
    if final_state is not None:
        final_state = final_state[: boundaries.num_docs]
    return o, final_state
