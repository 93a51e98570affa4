"""Softmax attention within each document of a packed row (docs/api.md §4)."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.attention.check import OP, signature_of
from hybrid_pack.ops.attention.cp import varlen_attention_cp
from hybrid_pack.ops.dispatch.route import OpRoute
from hybrid_pack.ops.library import PackedCustomOp
from hybrid_pack.ops.validate import (
    check_devices,
    check_packed,
    check_shape,
    check_sizes,
    default_scale,
    needs_grad,
    packed_tokens,
)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     boundaries: PackedBoundaries | StaticBoundaries, *,
                     causal: bool = True, softmax_scale: float | None = None, window: int | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """Attention where each token sees only tokens of its own document.

    Args:
        q: ``[1, T, H, D]``.
        k, v: ``[1, T, Hkv, D]`` with ``H % Hkv == 0`` (grouped-query attention).
        boundaries: where the documents of the row start; a :class:`~hybrid_pack.parallel.ShardedBoundaries`
            (this rank's part of a row split across a context-parallel group) runs the context-parallel
            path and returns this rank's slice of the whole row's result (docs/parallel.md).
        causal: mask future tokens.
        softmax_scale: defaults to ``D ** -0.5``.
        window: sliding-window attention (causal only): query ``i`` sees keys ``j`` of its document with
            ``i - j < window`` (transformers' ``sliding_window``: the token itself and ``window - 1`` before it).
            None: no window.
        backend: force a backend (see :mod:`hybrid_pack.backends`).

    Returns:
        ``[1, T, H, D]`` in the dtype of ``q``.
    """
    q_shape, k_shape = q.shape, k.shape
    valid = len(q_shape) == 4 and len(k_shape) == 4 and q_shape[2] and q_shape[3] and k_shape[2] and k_shape[3] \
        and q_shape[2] % k_shape[2] == 0
    if valid:  # one comparison; the checks naming the field run only when it fails
        _, _, h, head_dim = q_shape
        device = q.device
        t_len = packed_tokens(boundaries, device)  # None: not boundaries, or elsewhere
        kv_shape = (1, t_len, k_shape[2], head_dim)
        dtype = q.dtype
        valid = (q_shape, k_shape, v.shape, k.device, v.device, k.dtype, v.dtype) == (
            (1, t_len, h, head_dim), kv_shape, kv_shape, device, device, dtype, dtype)
    if not valid:
        _check(q, k, v, boundaries)
    if window is not None:
        _check_window(window, causal)
    scale = default_scale(q_shape[-1]) if softmax_scale is None else float(softmax_scale)
    return ROUTE((q, k, v), {"causal": causal, "softmax_scale": scale, "window": window}, boundaries,
                 backend=backend, requires_grad=needs_grad(q, k, v))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries | StaticBoundaries
           ) -> None:
    """Raise :class:`InputError` naming the first of ``q``, ``k``, ``v`` at fault."""
    check_packed("q", q, boundaries, 4)
    check_packed("k", k, boundaries, 4)
    check_sizes("q", q)
    check_sizes("k", k)
    check_shape("v", v, k.shape)
    check_devices("q", q, v=v)
    if q.shape[-1] != k.shape[-1]:
        raise InputError(f"k: expected head dim {q.shape[-1]} (that of q); got shape {list(k.shape)}")
    if q.shape[2] % k.shape[2]:
        raise InputError(f"k: expected a number of heads dividing q's {q.shape[2]}; got {k.shape[2]}")
    if not q.dtype == k.dtype == v.dtype and not torch.is_autocast_enabled(q.device.type):
        raise InputError(f"k, v: expected q's dtype {q.dtype} (cast them, or call inside torch.autocast, which casts "
                         f"all three); got k {k.dtype} and v {v.dtype}")


def _check_window(window: int | None, causal: bool) -> None:
    """Raise :class:`InputError` unless ``window`` is None or a positive int on causal attention."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InputError(f"window: expected None or a positive int (keys each query sees, itself included); "
                         f"got {window!r}")
    if not causal:
        raise InputError(f"window: {window} is sliding-window causal attention; pass causal=True or window=None")


def _key(tensors: tuple[torch.Tensor, ...], options: dict[str, Any]) -> tuple[Any, ...]:
    """The route's key: the sizes but ``T``, the flags and the dtypes."""
    q, k, v = tensors
    _, _, h, head_dim = q.shape
    return (h, head_dim, k.shape[2], options["causal"], options["window"], q.dtype, k.dtype, v.dtype)


ROUTE = OpRoute(
    OP, varlen_attention, positional=("q", "k", "v"),
    key=_key,
    signature=lambda a: signature_of(a["q"], a["k"], a["v"], a["causal"], a["window"]), sharded=varlen_attention_cp,
    opaque=PackedCustomOp("varlen_attention", ("q", "k", "v"), "bool causal, float softmax_scale, int? window",
                          varlen_attention),
    from_opaque=lambda outputs, _: outputs[0],
    layouts=("contiguous", "zigzag"))
