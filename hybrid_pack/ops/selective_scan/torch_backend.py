"""The Mamba-1 selective scan over the documents of a packed row, all documents side by side.

``h_t = exp(dt_t A) ⊙ h_{t-1} + (dt_t x_t) B_t^T`` and ``y_t = h_t C_t``, with a state ``h`` of shape
``[D, N]`` per token. Every segment of the row becomes one row of an ``[S, L]`` layout
(:meth:`PackedBoundaries.chunk_layout` with ``L = max_seqlen``), so all segments run in parallel over
``max_seqlen`` steps, each from a zero state. Exact; reads the segments' lengths on the host.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["scan"]


def scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
         boundaries: PackedBoundaries) -> torch.Tensor:
    """The state-space part of the selective scan, restarting at every segment.

    Args:
        x, dt: ``[T, D]`` (``dt`` discretised: ``softplus(dt + dt_bias)``).
        A: ``[D, N]``.
        B, C: ``[T, N]``.
        boundaries: the row's segments.

    Returns:
        ``y [T, D]`` in the inputs' (common) dtype.
    """
    layout = boundaries.chunk_layout(boundaries.max_seqlen)
    xs, dts, Bs, Cs = (layout.to_chunks(t) for t in (x, dt, B, C))             # [S, L, D] / [S, L, N]
    decay = torch.exp(dts.unsqueeze(-1) * A)                                   # [S, L, D, N]
    inject = (dts * xs).unsqueeze(-1) * Bs.unsqueeze(-2)                        # [S, L, D, N]
    state = xs.new_zeros(xs.shape[0], xs.shape[2], A.shape[-1])
    outputs = []
    for step in range(layout.chunk_size):
        state = decay[:, step] * state + inject[:, step]
        outputs.append((state @ Cs[:, step].unsqueeze(-1)).squeeze(-1))
    return layout.from_chunks(torch.stack(outputs, dim=1))
