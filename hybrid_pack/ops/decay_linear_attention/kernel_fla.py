"""flash-linear-attention adapter: ``chunk_simple_gla`` with a per-token scalar decay and ``cu_seqlens``.

``cu_seqlens`` keeps documents apart: one state per segment, reset at each start. The decay goes in as fla's
per-token gate ``g`` (a constant per-head decay arrives here already broadcast over the tokens by the public op),
not as ``g_gamma``: the kernel's backward returns no gradient for ``g_gamma``, and the gradient of ``g`` is part
of what the self-check compares. The host copy of ``cu_seqlens`` fla would otherwise read from the device comes
from :meth:`PackedBoundaries.kernel_chunk_index`.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["decay_linear_attention", "KERNEL_CHUNK_SIZE"]

KERNEL_CHUNK_SIZE = 64  # the chunk length of chunk_simple_gla


def decay_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           boundaries: PackedBoundaries, *, scale: float, initial_state: torch.Tensor | None,
                           output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`hybrid_pack.ops.decay_linear_attention` through fla's ``chunk_simple_gla(cu_seqlens=...)``.

    fla keeps one state per ``cu_seqlens`` segment, the padding segment included: it starts from zero here and
    its final state is dropped.
    """
    from fla.ops.simple_gla import chunk_simple_gla

    _, cu_seqlens_cpu = boundaries.kernel_chunk_index(KERNEL_CHUNK_SIZE)
    num_pad_segments = boundaries.num_segments - boundaries.num_docs
    if initial_state is not None and num_pad_segments:
        initial_state = torch.cat([initial_state, initial_state.new_zeros(num_pad_segments, *initial_state.shape[1:])])
    o, final_state = chunk_simple_gla(q, k, v, g=g, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=boundaries.cu_seqlens,
                                      cu_seqlens_cpu=cu_seqlens_cpu, chunk_size=KERNEL_CHUNK_SIZE)
    if final_state is not None:
        final_state = final_state[: boundaries.num_docs]
    return o, final_state
