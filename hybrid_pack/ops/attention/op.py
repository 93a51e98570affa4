"""Softmax attention within each document of a packed row (docs/api.md §4)."""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.attention.check import OP, signature_of
from hybrid_pack.ops.attention.cp import varlen_attention_cp
from hybrid_pack.ops.cp.eager import eager_on_shards
from hybrid_pack.ops.dispatch.route import OpRoute
from hybrid_pack.ops.library import PackedCustomOp
from hybrid_pack.ops.validate import check_packed, check_shape, needs_grad


@eager_on_shards
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
    check_packed("q", q, boundaries, 4)
    check_packed("k", k, boundaries, 4)
    check_shape("v", v, k.shape)
    if q.shape[-1] != k.shape[-1]:
        raise InputError(f"k: expected head dim {q.shape[-1]} (that of q); got shape {list(k.shape)}")
    if q.shape[2] % k.shape[2]:
        raise InputError(f"k: expected a number of heads dividing q's {q.shape[2]}; got {k.shape[2]}")
    _check_window(window, causal)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    return ROUTE({"q": q, "k": k, "v": v, "causal": causal, "softmax_scale": scale, "window": window}, boundaries,
                 backend=backend, requires_grad=needs_grad(q, k, v))


def _check_window(window: int | None, causal: bool) -> None:
    """Raise :class:`InputError` unless ``window`` is None or a positive int on causal attention."""
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise InputError(f"window: expected None or a positive int (keys each query sees, itself included); "
                         f"got {window!r}")
    if not causal:
        raise InputError(f"window: {window} is sliding-window causal attention; pass causal=True or window=None")


ROUTE = OpRoute(
    OP, varlen_attention, positional=("q", "k", "v"),
    key=lambda a: (a["q"].shape[2:], a["k"].shape[2], a["causal"], a["window"], a["q"].dtype, a["k"].dtype,
                   a["v"].dtype),
    signature=lambda a: signature_of(a["q"], a["k"], a["v"], a["causal"], a["window"]), sharded=varlen_attention_cp,
    opaque=PackedCustomOp("varlen_attention", ("q", "k", "v"), "bool causal, float softmax_scale, int? window",
                          varlen_attention),
    from_opaque=lambda outputs, _: outputs[0],
    layouts=("contiguous", "zigzag"))
