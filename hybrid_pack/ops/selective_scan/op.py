"""The Mamba-1 selective scan on a packed row, its state restarting at every document (Jamba's mixer).

``h_t = exp(dt_t A) ⊙ h_{t-1} + (dt_t x_t) B_t^T``, ``y_t = (h_t C_t + D ⊙ x_t) ⊙ silu(z_t)``, with a state
``h`` of shape ``[D, N]`` per token: a decay per channel and state entry, where Mamba-2's SSD has one per
head. Pure torch on every device: the packed scan (:mod:`.torch_backend`) on :class:`PackedBoundaries`, the
chunked static scan (:mod:`.torch_static`) on :class:`StaticBoundaries`, the packed scan with state passing
across rank edges (:mod:`.cp`) on a :class:`ShardedBoundaries`; no backend registry, no custom op.

``dt`` is discretised by the SSD's :func:`~hybrid_pack.ops.ssd.torch_backend.discretize_dt`:
``softplus(dt + dt_bias)``, as Hugging Face's Jamba and mamba-ssm's ``selective_scan_fn`` compute it with
``delta_softplus=True`` (the only way Jamba calls it). The SSD then clamps at zero (mamba-ssm's Mamba-2
``dt_limit=(0, inf)``), a no-op after softplus in value and gradient, so the computation is the same; Mamba-1
without softplus would not clamp, which is why this scan offers no ``dt_softplus=False``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.selective_scan import cp, torch_backend, torch_static
from hybrid_pack.ops.ssd.torch_backend import discretize_dt
from hybrid_pack.ops.validate import check_packed, check_shape, state_dtype
from hybrid_pack.parallel.boundaries import ShardedBoundaries
from hybrid_pack.parallel.compile import eager_on_shards
from hybrid_pack.parallel.relayout import on_contiguous

__all__ = ["selective_scan"]


@eager_on_shards
def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   boundaries: PackedBoundaries | StaticBoundaries | ShardedBoundaries, *,
                   D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                   dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Selective scan over a packed row; no state crosses a segment boundary.

    Args:
        x, dt: ``[1, T, D]`` (``dt`` before ``dt_bias`` and softplus).
        A: ``[D, N]`` (negative).
        B, C: ``[1, T, N]``.
        boundaries: where the documents of the row start (eager or static); a
            :class:`~hybrid_pack.parallel.ShardedBoundaries` runs this rank's part of a row split across a
            context-parallel group (:func:`.cp.scan`: the state of a document crossing a rank edge is passed on;
            the per-token tensors of another layout than the contiguous one move to it and back,
            :func:`~hybrid_pack.parallel.relayout.on_contiguous`).
        D: ``[D]`` skip connection.
        z: ``[1, T, D]`` gate: the output is multiplied by ``silu(z)``.
        dt_bias: ``[D]``.

    Returns:
        ``y [1, T, D]`` in x's dtype (computed in float32, or float64 for float64 inputs); on a shard, this rank's
        ``T_local`` tokens of the whole row's result.
    """
    check_packed("x", x, boundaries, 3)
    channels = x.shape[-1]
    if A.dim() != 2 or A.shape[0] != channels:
        raise InputError(f"A: expected shape [D={channels}, N]; got {list(A.shape)}")
    check_shape("dt", dt, x.shape)
    check_shape("B", B, (*x.shape[:2], A.shape[1]))
    check_shape("C", C, B.shape)
    check_shape("D", D, (channels,))
    check_shape("z", z, x.shape)
    check_shape("dt_bias", dt_bias, (channels,))
    if isinstance(boundaries, ShardedBoundaries):
        boundaries.check_group()
        if boundaries.layout != "contiguous":
            arguments = {"x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias}
            return on_contiguous(lambda moved, contiguous: selective_scan(**moved, boundaries=contiguous),
                                 arguments, boundaries)
    dtype = state_dtype(x.dtype)
    step = discretize_dt(dt[0].to(dtype), None if dt_bias is None else dt_bias.to(dtype), dt_softplus=True)
    tokens = x[0].to(dtype)
    inputs = (tokens, step, A.to(dtype), B[0].to(dtype), C[0].to(dtype))
    if isinstance(boundaries, ShardedBoundaries):
        y = cp.scan(*inputs, boundaries)
    elif isinstance(boundaries, StaticBoundaries):
        y = torch_static.scan(*inputs, boundaries)
    else:
        y = torch_backend.scan(*inputs, boundaries)
    if D is not None:
        y = y + tokens * D.to(dtype)
    if z is not None:
        y = y * F.silu(z[0].to(dtype))
    return y.unsqueeze(0).to(x.dtype)
