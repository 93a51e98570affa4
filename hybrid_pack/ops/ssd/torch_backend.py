"""Mamba-2 SSD in pure torch: the chunked state-space-duality algorithm over per-document chunks.

Per head ``h`` (group ``g = h // (H // G)``), with ``a_t = dt_t A_h``::

    h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T          # [P, N]
    y_t = (h_t C_t + D_h x_t) * silu(z_t)

Every document is cut into chunks of ``C`` tokens (:meth:`PackedBoundaries.chunk_layout`), so no chunk straddles
two documents. Inside a chunk the recurrence is a masked quadratic form: with ``s_i`` the
inclusive cumulative sum of ``a`` over the chunk,

    y_i = sum_{j <= i} exp(s_i - s_j) (C_i . B_j) dt_j x_j  +  exp(s_i) h_in C_i

where ``h_in`` is the state entering the chunk. Each chunk's own contribution to the state at
its end, ``sum_j exp(s_last - s_j) dt_j x_j B_j^T``, is computed for all chunks at once; a scan
over chunk steps then carries ``h`` from chunk to chunk, one state row per document, starting
from zero or ``initial_states[n]``. The masked tail slots of a document's last chunk hold
``dt = 0`` (no decay, no input), so they change nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import ChunkLayout, PackedBoundaries
from hybrid_pack.ops.validate import state_dtype, without_autocast


def skip_and_gate(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    """``(y + D x) * silu(z)`` (each part when given), in ``y``'s dtype: ``y, x [T, H, P]``, ``D [H]`` or
    ``[H, P]``, ``z [1, T, H, P]``."""
    if D is not None:
        y = y + x * (D.to(y.dtype) if D.dim() == 2 else D.to(y.dtype)[:, None])
    if z is not None:
        y = y * F.silu(z[0].to(y.dtype))
    return y


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool) -> torch.Tensor:
    """``dt + dt_bias``, then softplus, then clamped at 0 (mamba-ssm's default ``dt_limit=(0, inf)``)."""
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=0.0)


def _scan_chunks(layout: ChunkLayout, chunk_states: torch.Tensor, chunk_decay: torch.Tensor,
                 initial: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry the state across chunk steps.

    Args:
        chunk_states: ``[M, H, P, N]``, each chunk's own state at its end.
        chunk_decay: ``[M, H]``, ``exp`` of each chunk's summed log-decay.
        initial: ``[S, H, P, N]``, starting state of each segment in ranked order.

    Returns:
        ``(incoming [M, H, P, N], final [S, H, P, N])``: the state entering every chunk row, and
        every segment's final state in ranked order.
    """
    state = initial
    incoming, finished = [], []
    for step in range(layout.num_steps):
        lo, hi = layout.step_offsets[step], layout.step_offsets[step + 1]
        active = hi - lo
        if state.shape[0] > active:
            finished.append(state[active:])
            state = state[:active]
        incoming.append(state)
        state = chunk_decay[lo:hi, :, None, None] * state + chunk_states[lo:hi]
    finished.append(state)
    return torch.cat(incoming), torch.cat(finished[::-1])


@without_autocast
def mamba2_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               boundaries: PackedBoundaries, *, D: torch.Tensor | None, z: torch.Tensor | None,
               dt_bias: torch.Tensor | None, dt_softplus: bool, chunk_size: int,
               initial_states: torch.Tensor | None,
               return_final_states: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Chunked SSD scan of a packed row; the state restarts at every document.

    Shapes as in :func:`hybrid_pack.ops.mamba2_ssd`: x ``[1, T, H, P]``, dt ``[1, T, H]``, A ``[H]``,
    B/C ``[1, T, G, N]``, D ``[H]`` or ``[H, P]``, z ``[1, T, H, P]``, dt_bias ``[H]``,
    initial_states ``[num_docs, H, P, N]``. Computed in float32 (float64 for float64 inputs).

    Returns:
        ``y [1, T, H, P]`` in x's dtype, or ``(y, final_states [num_docs, H, P, N])`` with the
        final states in the compute dtype (float32, or float64 for float64 inputs).
    """
    _, _, heads, head_dim = x.shape
    groups, state_dim = B.shape[2], B.shape[3]
    heads_per_group = heads // groups
    cdtype = state_dtype(x.dtype)
    layout = boundaries.chunk_layout(chunk_size)
    rows, size = layout.num_rows, layout.chunk_size

    x_f = x[0].to(cdtype)
    dt_f = discretize_dt(dt[0].to(cdtype), None if dt_bias is None else dt_bias.to(cdtype), dt_softplus)

    # Chunk rows, head-major: [M, G, r, C, ...] with r = heads per group.
    xc = layout.to_chunks(x_f).permute(0, 2, 1, 3)                      # [M, H, C, P]
    dtc = layout.to_chunks(dt_f).transpose(1, 2)                        # [M, H, C], 0 in masked slots
    Bc = layout.to_chunks(B[0].to(cdtype)).transpose(1, 2).unsqueeze(2)  # [M, G, 1, C, N]
    Cc = layout.to_chunks(C[0].to(cdtype)).transpose(1, 2).unsqueeze(2)  # [M, G, 1, C, N]
    log_decay = torch.cumsum(dtc * A.to(cdtype)[:, None], dim=-1)       # [M, H, C], inclusive
    x_dt = (xc * dtc[..., None]).view(rows, groups, heads_per_group, size, head_dim)

    # Intra-chunk: y_i += sum_{j <= i} exp(s_i - s_j) (C_i . B_j) dt_j x_j.
    causal = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
    segsum = log_decay[..., :, None] - log_decay[..., None, :]
    decay = torch.exp(torch.where(causal, segsum, float("-inf")))
    scores = (Cc @ Bc.transpose(-1, -2)) * decay.view(rows, groups, heads_per_group, size, size)
    y = scores @ x_dt                                                   # [M, G, r, C, P]

    # Each chunk's own state at its end, then the scan carrying states across chunks.
    decay_to_end = torch.exp(log_decay[..., -1:] - log_decay).view(rows, groups, heads_per_group, size, 1)
    chunk_states = ((x_dt * decay_to_end).transpose(-1, -2) @ Bc).view(rows, heads, head_dim, state_dim)
    initial = torch.zeros(boundaries.num_segments, heads, head_dim, state_dim, dtype=cdtype, device=x.device)
    if initial_states is not None:
        initial = torch.cat([initial_states.to(cdtype), initial[boundaries.num_docs:]])
    incoming, final_ranked = _scan_chunks(layout, chunk_states, torch.exp(log_decay[..., -1]), initial[layout.order])

    # Inter-chunk: y_i += exp(s_i) h_in C_i.
    incoming = incoming.view(rows, groups, heads_per_group, head_dim, state_dim)
    y = y + (Cc @ incoming.transpose(-1, -2)) * torch.exp(log_decay).view(rows, groups, heads_per_group, size, 1)

    y = layout.from_chunks(y.view(rows, heads, size, head_dim).transpose(1, 2))  # [T, H, P]
    y = skip_and_gate(y, x_f, D, z).to(x.dtype).unsqueeze(0)
    if not return_final_states:
        return y
    return y, final_ranked[layout.rank_of_segment[: boundaries.num_docs]]
