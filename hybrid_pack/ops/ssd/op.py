"""The Mamba-2 state-space duality (SSD) scan with its state reset at every document start."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.dispatch.route import OpRoute
from hybrid_pack.ops.library import PackedCustomOp
from hybrid_pack.ops.ssd.check import OP, signature_of
from hybrid_pack.ops.ssd.cp import mamba2_ssd_cp
from hybrid_pack.ops.validate import (
    check_devices,
    check_packed,
    check_shape,
    check_sizes,
    document_slots,
    needs_grad,
    on_device,
    packed_tokens,
    shape_of,
    state_dtype,
)


def mamba2_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               boundaries: PackedBoundaries | StaticBoundaries, *, D: torch.Tensor | None = None,
               z: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
               chunk_size: int = 64, initial_states: torch.Tensor | None = None, return_final_states: bool = False,
               backend: str | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 SSD: ``h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T``, ``y_t = C_t^T h_t + D x_t``.

    ``dt`` is ``softplus(dt + dt_bias)`` when ``dt_softplus``, then clamped at 0 (as mamba-ssm's default
    ``dt_limit``); ``y`` is gated by ``silu(z)`` when ``z``
    is given. ``h`` starts from zero (or ``initial_states[n]``) at the first token of each document.

    Args:
        x: ``[1, T, H, P]``.
        dt: ``[1, T, H]``.
        A: ``[H]`` (negative).
        B, C: ``[1, T, G, N]`` with ``H % G == 0``.
        boundaries: where the documents of the row start; a :class:`~hybrid_pack.parallel.ShardedBoundaries`
            runs this rank's slice of a row split across a context-parallel group (see
            :func:`~hybrid_pack.ops.ssd.cp.mamba2_ssd_cp` for what the initial and final states then mean).
        D: ``[H]`` or ``[H, P]`` skip connection.
        z: ``[1, T, H, P]`` gate.
        dt_bias: ``[H]``.
        chunk_size: the chunk length of the chunked scan (a speed knob; results do not depend on it).
        initial_states: ``[N, H, P, N_state]`` for the ``N = boundaries.num_docs`` documents; with
            :class:`StaticBoundaries`, one per segment slot (``N = boundaries.num_segments``).
        return_final_states: also return each document's final state ``[N, H, P, N_state]`` (float32;
            float64 for float64 inputs).
        backend: force a backend (see :mod:`hybrid_pack.backends`).

    Returns:
        ``y [1, T, H, P]`` in x's dtype, or ``(y, final_states)``.
    """
    x_shape, b_shape = x.shape, B.shape
    valid = len(x_shape) == 4 and len(b_shape) == 4 and x_shape[2] and x_shape[3] and b_shape[2] and b_shape[3] \
        and x_shape[2] % b_shape[2] == 0 and type(chunk_size) is int
    if valid:  # one comparison; the checks naming the field run only when it fails
        _, _, h, p = x_shape
        _, _, g, n = b_shape
        device = x.device
        t_len = packed_tokens(boundaries, device)  # None: not boundaries, or elsewhere
        heads, d_shape = (h,), shape_of(D)
        states = None if initial_states is None or t_len is None else (document_slots(boundaries), h, p, n)
        valid = (x_shape, dt.shape, A.shape, b_shape, C.shape, shape_of(z), shape_of(dt_bias),
                 shape_of(initial_states), B.device) == (
            (1, t_len, h, p), (1, t_len, h), heads, (1, t_len, g, n), b_shape, None if z is None else x_shape,
            None if dt_bias is None else heads, states, device) and (
            d_shape is None or d_shape == heads or d_shape == (h, p)) and chunk_size >= 1 and on_device(
            device, dt, A, C, D, z, dt_bias, initial_states)
    if not valid:
        _check(x, dt, A, B, C, D, z, dt_bias, initial_states, boundaries, chunk_size)
    requires_grad = needs_grad(x, dt, A, B, C, D, z, dt_bias, initial_states)
    options = {"D": D, "z": z, "dt_bias": dt_bias, "dt_softplus": dt_softplus, "chunk_size": chunk_size,
               "initial_states": initial_states, "return_final_states": return_final_states}
    return ROUTE((x, dt, A, B, C), options, boundaries, backend=backend, requires_grad=requires_grad)


def _check(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
           initial_states: torch.Tensor | None, boundaries: PackedBoundaries | StaticBoundaries, chunk_size: int
           ) -> None:
    """Raise :class:`InputError` naming the first input at fault."""
    check_packed("x", x, boundaries, 4)
    check_sizes("x", x)
    _, t_len, h, p = x.shape
    check_shape("dt", dt, (1, t_len, h))
    check_shape("A", A, (h,))
    check_packed("B", B, boundaries, 4)
    check_sizes("B", B)
    check_shape("C", C, B.shape)
    g, n = B.shape[2], B.shape[3]
    if h % g:
        raise InputError(f"B: expected a number of groups dividing the {h} heads; got {g}")
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        raise InputError(f"D: expected shape [{h}] or [{h}, {p}]; got {list(D.shape)}")
    check_shape("z", z, x.shape)
    check_shape("dt_bias", dt_bias, (h,))
    check_shape("initial_states", initial_states, (document_slots(boundaries), h, p, n))
    check_devices("x", x, dt=dt, A=A, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states)
    if type(chunk_size) is not int or chunk_size < 1:
        raise InputError(f"chunk_size: expected a positive int; got {chunk_size!r}")


def _eager(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
           D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None,
           initial_states: torch.Tensor | None, boundaries: PackedBoundaries, **options: object) -> object:
    return mamba2_ssd(x, dt, A, B, C, boundaries, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states, **options)


def _fake(tensors: list[torch.Tensor], num_segments: int, *, return_final_states: bool,
          **options: object) -> list[torch.Tensor]:
    x, B = tensors[0], tensors[3]
    dtype_of_states = state_dtype(x.dtype)
    states = [x.new_empty((num_segments, x.shape[2], x.shape[3], B.shape[3]), dtype=dtype_of_states)]
    return [x.new_empty(x.shape), *(states if return_final_states else [])]


def _key(tensors: tuple[torch.Tensor, ...], options: dict[str, Any]) -> tuple[Any, ...]:
    """The route's key: the sizes but ``T``, the flags and the dtypes (an absent input's None)."""
    x, dt, A, B, C = tensors
    D, z, dt_bias, initial_states = options["D"], options["z"], options["dt_bias"], options["initial_states"]
    _, _, h, p = x.shape
    _, _, g, n = B.shape
    return (h, p, g, n, options["chunk_size"], None if D is None else D.dim(), options["dt_softplus"],
            options["return_final_states"], x.dtype, dt.dtype, A.dtype, B.dtype, C.dtype,
            None if D is None else D.dtype, None if z is None else z.dtype,
            None if dt_bias is None else dt_bias.dtype, None if initial_states is None else initial_states.dtype)


ROUTE = OpRoute(
    OP, mamba2_ssd, positional=("x", "dt", "A", "B", "C"),
    key=_key,
    signature=lambda a: signature_of(a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], z=a["z"],
                                     dt_bias=a["dt_bias"], dt_softplus=a["dt_softplus"], chunk_size=a["chunk_size"],
                                     initial_states=a["initial_states"],
                                     return_final_states=a["return_final_states"]),
    sharded=mamba2_ssd_cp,
    opaque=PackedCustomOp("mamba2_ssd", ("x", "dt", "A", "B", "C", "D?", "z?", "dt_bias?", "initial_states?"),
                          "bool dt_softplus, int chunk_size, bool return_final_states", _eager, fake=_fake,
                          state_input=8),
    from_opaque=lambda outputs, a: (outputs[0], outputs[1]) if a["return_final_states"] else outputs[0],
    layouts=("contiguous",))
