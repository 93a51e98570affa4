"""Decay linear attention (MiniMax's lightning attention) with its state reset at every document start
(docs/api.md §4)."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.decay_linear_attention.check import OP, signature_of
from hybrid_pack.ops.decay_linear_attention.cp import decay_linear_attention_cp
from hybrid_pack.ops.dispatch.route import OpRoute
from hybrid_pack.ops.library import PackedCustomOp
from hybrid_pack.ops.validate import (
    check_devices,
    check_packed,
    check_shape,
    check_sizes,
    default_scale,
    document_slots,
    needs_grad,
    on_device,
    packed_tokens,
    shape_of,
    state_dtype,
)


def decay_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           boundaries: PackedBoundaries | StaticBoundaries, *, scale: float | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``S_t = exp(g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale S_t^T q_t``.

    ``S`` starts from zero (or ``initial_state[n]``) at the first token of each document ``n``. MiniMax's lightning
    attention is this with ``g = -slope_rate`` (a constant per head) and ``scale = 1``; fla's simple GLA is it with
    a data-dependent ``g``.

    Args:
        q, k: ``[1, T, H, K]``.
        v: ``[1, T, H, V]``.
        g: log decay (<= 0): ``[H]``, the same at every token (its gradient is the sum over the tokens), or
            ``[1, T, H]``, one per token.
        boundaries: where the documents of the row start; a :class:`~hybrid_pack.parallel.ShardedBoundaries` runs
            this rank's slice of a row split across a context-parallel group (see
            :func:`~hybrid_pack.ops.decay_linear_attention.cp.decay_linear_attention_cp` for what ``initial_state``
            and the final states then mean).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` for the ``N = boundaries.num_docs`` documents (the padding segment, if any,
            starts from zero); with :class:`StaticBoundaries`, one per segment slot (``N = boundaries.num_segments``).
        output_final_state: also return each document's final state ``[N, H, K, V]`` (float32; float64 for float64
            inputs).
        backend: force a backend (see :mod:`hybrid_pack.backends`).

    Returns:
        ``(o [1, T, H, V] in v's dtype, final_state or None)``.
    """
    q_shape, v_shape, g_shape = q.shape, v.shape, g.shape
    valid = len(q_shape) == 4 and len(v_shape) == 4 and q_shape[2] and q_shape[3] and v_shape[2] and v_shape[3]
    if valid:  # one comparison; the checks naming the field run only when it fails
        _, _, h, k_dim = q_shape
        v_dim = v_shape[3]
        device = q.device
        t_len = packed_tokens(boundaries, device)  # None: not boundaries, or elsewhere
        states = None if initial_state is None or t_len is None else (document_slots(boundaries), h, k_dim, v_dim)
        valid = (q_shape, k.shape, v_shape, g_shape, shape_of(initial_state), k.device, v.device) == (
            (1, t_len, h, k_dim), q_shape, (1, t_len, h, v_dim), (h,) if len(g_shape) == 1 else (1, t_len, h),
            states, device, device) and on_device(device, g, initial_state)
    if not valid:
        _check(q, k, v, g, initial_state, boundaries)
    if len(g_shape) == 1:  # one decay per head: the same at every token
        g = g.expand(1, q_shape[1], q_shape[2])
    scale = default_scale(q_shape[3]) if scale is None else float(scale)
    return ROUTE((q, k, v, g), {"scale": scale, "initial_state": initial_state,
                                "output_final_state": output_final_state},
                 boundaries, backend=backend, requires_grad=needs_grad(q, k, v, g, initial_state))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None,
           boundaries: PackedBoundaries | StaticBoundaries) -> None:
    """Raise :class:`InputError` naming the first input at fault."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_packed(name, t, boundaries, 4)
        check_sizes(name, t)
    check_shape("k", k, q.shape)
    _, t_len, h, k_dim = q.shape
    if v.shape[2] != h:
        raise InputError(f"v: expected {h} heads (q's); got shape {list(v.shape)}")
    check_shape("g", g, (h,) if g.dim() == 1 else (1, t_len, h))
    check_devices("q", q, g=g, initial_state=initial_state)
    check_shape("initial_state", initial_state, (document_slots(boundaries), h, k_dim, v.shape[3]))


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, initial_state: torch.Tensor | None,
           boundaries: PackedBoundaries, **options: object) -> tuple[torch.Tensor, torch.Tensor | None]:
    return decay_linear_attention(q, k, v, g, boundaries, initial_state=initial_state, **options)


def _fake(tensors: list[torch.Tensor], num_segments: int, *, output_final_state: bool,
          **options: object) -> list[torch.Tensor]:
    q, k, v = tensors[:3]
    dtype_of_states = state_dtype(torch.promote_types(q.dtype, v.dtype))  # as the torch backend's
    state = [q.new_empty((num_segments, v.shape[2], k.shape[3], v.shape[3]), dtype=dtype_of_states)]
    return [v.new_empty(v.shape), *(state if output_final_state else [])]


def _key(tensors: tuple[torch.Tensor, ...], options: dict[str, Any]) -> tuple[Any, ...]:
    """The route's key: the sizes but ``T``, the flag and the dtypes."""
    q, k, v, g = tensors
    initial_state = options["initial_state"]
    _, _, h, k_dim = q.shape
    return (h, k_dim, v.shape[3], options["output_final_state"], q.dtype, k.dtype, v.dtype, g.dtype,
            None if initial_state is None else initial_state.dtype)


ROUTE = OpRoute(
    OP, decay_linear_attention, positional=("q", "k", "v", "g"),
    key=_key,
    signature=lambda a: signature_of(a["q"], a["k"], a["v"], a["g"], initial_state=a["initial_state"],
                                     output_final_state=a["output_final_state"]),
    sharded=decay_linear_attention_cp,
    opaque=PackedCustomOp("decay_linear_attention", ("q", "k", "v", "g", "initial_state?"),
                          "float scale, bool output_final_state", _eager, fake=_fake, state_input=4),
    from_opaque=lambda outputs, a: (outputs[0], outputs[1] if a["output_final_state"] else None),
    layouts=("contiguous",))
