"""Per-token Mamba-2 recurrence, one document at a time: the slow, obvious oracle for the SSD op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries


def mamba2_ssd_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                         boundaries: PackedBoundaries, *, D: torch.Tensor | None = None,
                         z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                         dt_softplus: bool = True, chunk_size: int | None = None,
                         initial_states: torch.Tensor | None = None, return_final_states: bool = True
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = (h_t C_t + D x_t) * silu(z_t)``, token by token.

    Arguments and shapes as :func:`hybrid_pack.ops.mamba2_ssd` (a recurrence has no chunks: ``chunk_size``
    is taken and left unused). Computes in float32 (float64 for float64 x).

    Returns:
        ``(y [1, T, H, P] in x's dtype, final_states [num_docs, H, P, N])``, or ``y`` alone without
        ``return_final_states``.
    """
    cdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    heads, head_dim = x.shape[2:]
    groups, state_dim = B.shape[2:]
    group_of_head = torch.arange(heads, device=x.device) // (heads // groups)
    dt = dt[0].to(cdtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(cdtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(min=0.0)
    A = A.to(cdtype)
    x_f = x[0].to(cdtype)
    B_h = B[0].to(cdtype)[:, group_of_head]  # [T, H, N]
    C_h = C[0].to(cdtype)[:, group_of_head]

    outputs, finals = [], []
    for doc, (start, length) in enumerate(zip(boundaries.starts, boundaries.segment_lengths)):
        if initial_states is not None and doc < boundaries.num_docs:
            state = initial_states[doc].to(cdtype)
        else:
            state = torch.zeros(heads, head_dim, state_dim, dtype=cdtype, device=x.device)
        for t in range(start, start + length):
            decay = torch.exp(dt[t] * A)[:, None, None]
            state = decay * state + (dt[t][:, None] * x_f[t])[:, :, None] * B_h[t][:, None, :]
            outputs.append(state @ C_h[t][:, :, None])
        if doc < boundaries.num_docs:
            finals.append(state)
    y = torch.stack(outputs).squeeze(-1)  # [T, H, P]
    if D is not None:
        y = y + x_f * (D.to(cdtype) if D.dim() == 2 else D.to(cdtype)[:, None])
    if z is not None:
        y = y * F.silu(z[0].to(cdtype))
    y = y.to(x.dtype).unsqueeze(0)
    return (y, torch.stack(finals)) if return_final_states else y
