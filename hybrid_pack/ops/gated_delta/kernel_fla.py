"""flash-linear-attention adapter: ``chunk_gated_delta_rule`` with ``cu_seqlens``.

``cu_seqlens`` keeps documents apart: one state per segment, reset at each start. The host index
fla would otherwise derive from it on the device with a sync (``chunk_indices``, every
``(segment, chunk)`` pair, and ``cu_seqlens_cpu``) comes from
:meth:`PackedBoundaries.kernel_chunk_index`, built once per row. On Hopper with a Triton that
miscompiles the gated backward, :mod:`.fla_hopper` supplies a correct kernel for that one step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.gated_delta import fla_hopper

__all__ = ["gated_delta_rule", "gated_delta_accepts", "KERNEL_CHUNK_SIZE", "MAX_HEAD_DIM"]

KERNEL_CHUNK_SIZE = 64  # the chunk length of chunk_gated_delta_rule
MAX_HEAD_DIM = 256  # chunk_delta_h holds the K dimension of the state in at most four 64-wide blocks


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

    fla_hopper.install()
    chunk_indices, cu_seqlens_cpu = boundaries.kernel_chunk_index(KERNEL_CHUNK_SIZE)
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
