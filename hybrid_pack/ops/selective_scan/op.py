"""The Mamba-1 selective scan with its state reset at every document start (docs/api.md §4).

``h_t = exp(dt_t A) ⊙ h_{t-1} + (dt_t x_t) B_t^T``, ``y_t = (h_t C_t + D ⊙ x_t) ⊙ silu(z_t)``, with a state
``h`` of shape ``[D, N]`` per token: a decay per channel and state entry, where Mamba-2's SSD has one per head.
``dt`` is ``softplus(dt + dt_bias)``, as Hugging Face's Mamba, FalconMamba, Zamba and Jamba and mamba-ssm's
``selective_scan_fn`` with ``delta_softplus=True`` compute it (the only way those models call it), so the op offers
no ``dt_softplus=False``.
"""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.dispatch.route import OpRoute
from hybrid_pack.ops.library import PackedCustomOp
from hybrid_pack.ops.selective_scan.check import OP, signature_of
from hybrid_pack.ops.selective_scan.cp import selective_scan_cp
from hybrid_pack.ops.validate import (
    check_devices,
    check_packed,
    check_shape,
    check_sizes,
    needs_grad,
    on_device,
    packed_tokens,
    shape_of,
)

__all__ = ["selective_scan"]


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   boundaries: PackedBoundaries | StaticBoundaries | ShardedBoundaries, *,
                   D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                   dt_bias: torch.Tensor | None = None, backend: str | None = None) -> torch.Tensor:
    """Selective scan over a packed row; no state crosses a segment boundary.

    Args:
        x, dt: ``[1, T, D]`` (``dt`` before ``dt_bias`` and softplus).
        A: ``[D, N]`` (negative).
        B, C: ``[1, T, N]``.
        boundaries: where the documents of the row start (eager or static); a
            :class:`~hybrid_pack.parallel.ShardedBoundaries` runs this rank's part of a row split across a
            context-parallel group (:func:`.cp.selective_scan_cp`: the state of a document crossing a rank edge
            is passed on).
        D: ``[D]`` skip connection.
        z: ``[1, T, D]`` gate: the output is multiplied by ``silu(z)``.
        dt_bias: ``[D]``.
        backend: force a backend (see :mod:`hybrid_pack.backends`).

    Returns:
        ``y [1, T, D]`` in x's dtype (computed in float32, or float64 for float64 inputs); on a shard, this rank's
        ``T_local`` tokens of the whole row's result.
    """
    x_shape, a_shape = x.shape, A.shape
    valid = len(x_shape) == 3 and len(a_shape) == 2 and x_shape[2] and a_shape[0] and a_shape[1]
    if valid:  # one comparison; the checks naming the field run only when it fails
        channels = x_shape[2]
        t_len = packed_tokens(boundaries, x.device)  # None: not boundaries, or elsewhere
        b_shape, per_channel = (1, t_len, a_shape[1]), (channels,)
        valid = (x_shape, a_shape[0], dt.shape, B.shape, C.shape, shape_of(D), shape_of(z), shape_of(dt_bias)) == (
            (1, t_len, channels), channels, x_shape, b_shape, b_shape, None if D is None else per_channel,
            None if z is None else x_shape, None if dt_bias is None else per_channel) and on_device(
            x.device, dt, A, B, C, D, z, dt_bias)
    if not valid:
        _check(x, dt, A, B, C, D, z, dt_bias, boundaries)
    return ROUTE((x, dt, A, B, C), {"D": D, "z": z, "dt_bias": dt_bias}, boundaries, backend=backend,
                 requires_grad=needs_grad(x, dt, A, B, C, D, z, dt_bias))


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
           boundaries: PackedBoundaries | StaticBoundaries | ShardedBoundaries) -> None:
    """Raise :class:`InputError` naming the first input at fault."""
    check_packed("x", x, boundaries, 3)
    check_sizes("x", x)
    channels = x.shape[-1]
    if A.dim() != 2 or A.shape[0] != channels or A.shape[1] < 1:
        raise InputError(f"A: expected shape [D={channels}, N] with N >= 1; got {list(A.shape)}")
    check_shape("dt", dt, x.shape)
    check_shape("B", B, (*x.shape[:2], A.shape[1]))
    check_shape("C", C, B.shape)
    check_shape("D", D, (channels,))
    check_shape("z", z, x.shape)
    check_shape("dt_bias", dt_bias, (channels,))
    check_devices("x", x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)


def _eager(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
           boundaries: PackedBoundaries, **options: object) -> torch.Tensor:
    return selective_scan(x, dt, A, B, C, boundaries, D=D, z=z, dt_bias=dt_bias, **options)


def _key(tensors: tuple[torch.Tensor, ...], options: dict[str, Any]) -> tuple[Any, ...]:
    """The route's key: the sizes but ``T`` and the dtypes (an absent input's None)."""
    x, dt, A, B, C = tensors
    D, z, dt_bias = options["D"], options["z"], options["dt_bias"]
    channels, state = A.shape
    return (channels, state, x.dtype, dt.dtype, A.dtype, B.dtype, C.dtype, None if D is None else D.dtype,
            None if z is None else z.dtype, None if dt_bias is None else dt_bias.dtype)


ROUTE = OpRoute(
    OP, selective_scan, positional=("x", "dt", "A", "B", "C"),
    key=_key,
    signature=lambda a: signature_of(a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], z=a["z"],
                                     dt_bias=a["dt_bias"]),
    sharded=selective_scan_cp,
    opaque=PackedCustomOp("selective_scan", ("x", "dt", "A", "B", "C", "D?", "z?", "dt_bias?"), "", _eager),
    from_opaque=lambda outputs, a: outputs[0],
    layouts=("contiguous",))
