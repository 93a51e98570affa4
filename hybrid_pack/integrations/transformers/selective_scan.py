"""The Mamba-1 selective scan with its state reset at every document start (pure torch, exact).

``h_t = exp(dt_t A) ⊙ h_{t-1} + (dt_t x_t) B_t^T``, ``y_t = h_t C_t + D x_t``, with ``h`` of shape
``[D, N]`` per token. Every segment of the packed row becomes one row of a ``[S, L]`` layout
(:meth:`PackedBoundaries.chunk_layout` with ``L = max_seqlen``), so all documents run in
parallel and the loop runs ``max_seqlen`` steps; a segment's state starts at zero in its row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries

__all__ = ["selective_scan"]


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   boundaries: PackedBoundaries | StaticBoundaries, *, D: torch.Tensor | None = None,
                   z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                   dt_softplus: bool = True) -> torch.Tensor:
    """Selective scan over a packed row.

    Args:
        x, dt: ``[1, T, D]`` (``dt`` before ``dt_bias`` and softplus).
        A: ``[D, N]`` (negative).
        B, C: ``[1, T, N]``.
        boundaries: where the documents of the row start.
        D: ``[D]`` skip connection.
        z: ``[1, T, D]`` gate: the output is multiplied by ``silu(z)``.
        dt_bias: ``[D]``.
        dt_softplus: apply softplus to ``dt + dt_bias``.

    Returns:
        ``y [1, T, D]`` in x's dtype (computed in float32, or float64 for float64 inputs).
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    if isinstance(boundaries, StaticBoundaries):
        y = _scan_resetting(*(t[0].to(dtype) for t in (x, dt, B, C)), A.to(dtype), boundaries)
    else:
        y = _scan_documents(*(t[0].to(dtype) for t in (x, dt, B, C)), A.to(dtype), boundaries)
    if D is not None:
        y = y + x[0].to(dtype) * D.to(dtype)
    if z is not None:
        y = y * F.silu(z[0].to(dtype))
    return y.unsqueeze(0).to(x.dtype)


def _scan_documents(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A: torch.Tensor,
                    boundaries: PackedBoundaries) -> torch.Tensor:
    """``x, dt [T, D]``, ``B, C [T, N]`` -> ``y [T, D]``: all documents side by side, ``max_seqlen`` steps."""
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


def _scan_resetting(x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor, A: torch.Tensor,
                    boundaries: StaticBoundaries) -> torch.Tensor:
    """The same scan read from tensors only (a compiled graph): ``T`` steps, the state zeroed where a
    document starts (``position_ids == 0``)."""
    keep = (boundaries.document_positions[0] != 0).to(x.dtype)                 # [T]
    decay = torch.exp(dt.unsqueeze(-1) * A)                                    # [T, D, N]
    inject = (dt * x).unsqueeze(-1) * B.unsqueeze(-2)                          # [T, D, N]
    state = x.new_zeros(x.shape[1], A.shape[-1])
    outputs = []
    for step in range(x.shape[0]):
        state = decay[step] * state * keep[step] + inject[step]
        outputs.append(state @ C[step])
    return torch.stack(outputs)
