"""Depthwise causal 1-D convolution whose taps never cross a document boundary (docs/api.md §4)."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.conv.check import ACTIVATIONS, OP, signature_of
from hybrid_pack.ops.conv.cp import causal_conv1d_cp
from hybrid_pack.ops.dispatch.route import OpRoute
from hybrid_pack.ops.library import PackedCustomOp
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


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  boundaries: PackedBoundaries | StaticBoundaries,
                  *, activation: str | None = None, backend: str | None = None) -> torch.Tensor:
    """``y[t, d] = act(bias[d] + sum_i weight[d, i] * x[t - W + 1 + i, d])`` over taps in t's own document.

    Args:
        x: ``[1, T, D]``.
        weight: ``[D, W]``.
        bias: ``[D]`` or None.
        boundaries: where the documents of the row start; a :class:`~hybrid_pack.parallel.ShardedBoundaries`
            (this rank's part of a row split across a context-parallel group) runs the context-parallel
            path and returns this rank's slice of the whole row's result (docs/parallel.md).
        activation: None or ``"silu"`` (``"swish"`` is the same).
        backend: force a backend (see :mod:`hybrid_pack.backends`).

    Returns:
        ``[1, T, D]`` in the dtype of ``x``.
    """
    x_shape, w_shape = x.shape, weight.shape
    valid = len(x_shape) == 3 and len(w_shape) == 2 and 0 not in w_shape and activation in ACTIVATIONS
    if valid:  # one comparison; the checks naming the field run only when it fails
        channels = x_shape[2]
        valid = (x_shape, w_shape[0], shape_of(bias)) == (
            (1, packed_tokens(boundaries, x.device), channels), channels, None if bias is None else (channels,)
        ) and on_device(x.device, weight, bias)
    if not valid:
        _check(x, weight, bias, boundaries, activation)
    activation = "silu" if activation == "swish" else activation
    return ROUTE((x, weight, bias), {"activation": activation}, boundaries, backend=backend,
                 requires_grad=needs_grad(x, weight, bias))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           boundaries: PackedBoundaries | StaticBoundaries, activation: str | None) -> None:
    """Raise :class:`InputError` naming the first input at fault."""
    check_packed("x", x, boundaries, 3)
    check_sizes("x", x)
    if weight.dim() != 2 or weight.shape[0] != x.shape[-1] or weight.shape[1] < 1:
        raise InputError(f"weight: expected shape [D={x.shape[-1]}, W] with W >= 1; got {list(weight.shape)}")
    check_shape("bias", bias, (x.shape[-1],))
    check_devices("x", x, weight=weight, bias=bias)
    if activation not in ACTIVATIONS:
        raise InputError(f"activation: expected one of {ACTIVATIONS}; got {activation!r}")


def _key(tensors: tuple[torch.Tensor, ...], options: dict[str, Any]) -> tuple[Any, ...]:
    """The route's key: the sizes but ``T``, the activation and the dtypes (an absent bias's None)."""
    x, weight, bias = tensors
    return (x.shape[2], weight.shape[1], options["activation"], x.dtype, weight.dtype,
            None if bias is None else bias.dtype)


ROUTE = OpRoute(
    OP, causal_conv1d, positional=("x", "weight", "bias"),
    key=_key,
    signature=lambda a: signature_of(a["x"], a["weight"], a["bias"], a["activation"]), sharded=causal_conv1d_cp,
    opaque=PackedCustomOp("causal_conv1d", ("x", "weight", "bias?"), "str? activation", causal_conv1d),
    from_opaque=lambda outputs, _: outputs[0],
    layouts=("contiguous", "zigzag"))
