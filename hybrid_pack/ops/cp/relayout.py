"""A shard's tokens moved between layouts, differentiably, and an op run on the contiguous layout (docs/parallel.md).

The recurrent ops (Gated DeltaNet, the SSD) pass state from rank to rank along the row, which needs each
rank to hold one contiguous piece: under the zigzag layout they run on the contiguous layout, as
Megatron-LM runs Gated DeltaNet. :func:`to_contiguous` sends every token of a ``[1, T_local, ...]`` tensor
to the rank holding it under the contiguous layout (point to point, a local copy where that is this rank;
:mod:`hybrid_pack.ops.cp.exchange`), :func:`to_layout` sends it back; each one's backward is the other's
exchange. :func:`on_contiguous` runs a call on relayouted per-token arguments and relayouts its per-token
outputs back. Bytes sent per rank and tensor: the tokens it holds that another rank holds under the other
layout (``T_local / 2 * elements per token`` from zigzag to contiguous on 2 ranks or more).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries, layout_chunks
from hybrid_pack.errors import InputError
from hybrid_pack.ops.cp.exchange import TokenExchange, exchange_tokens, plan_exchange

__all__ = ["relayout_plan", "to_contiguous", "to_layout", "on_contiguous"]


def relayout_plan(boundaries: ShardedBoundaries, source: str, target: str) -> TokenExchange:
    """This rank's part of the exchange moving every token of the row from the rank holding it under the layout
    ``source`` to the rank holding it under ``target`` (one of :data:`~hybrid_pack.boundaries.sharded.LAYOUTS`
    each), in ``target``'s local order. Host-side; kept on ``boundaries``."""
    def build() -> TokenExchange:
        total, world = boundaries.row.total_tokens, boundaries.world_size
        wanted = [[(start, start + length) for start, length in layout_chunks(target, total, world, rank)]
                  for rank in range(world)]
        holdings = [layout_chunks(source, total, world, rank) for rank in range(world)]
        return plan_exchange(wanted, holdings, boundaries.rank)

    return boundaries.view(("relayout", source, target), build)


def _relayout(x: torch.Tensor, boundaries: ShardedBoundaries, source: str, target: str) -> torch.Tensor:
    if source == target:
        return x
    if x.dim() < 2 or tuple(x.shape[:2]) != (1, boundaries.local.total_tokens):
        raise InputError(f"x: expected this rank's tokens [1, {boundaries.local.total_tokens}, ...]; got shape "
                         f"{list(x.shape)}")
    return exchange_tokens(x[0], relayout_plan(boundaries, source, target), boundaries.group).unsqueeze(0)


def to_contiguous(x: torch.Tensor, boundaries: ShardedBoundaries) -> torch.Tensor:
    """This rank's tokens under the contiguous layout, from its tokens under ``boundaries.layout``.

    A collective over ``boundaries.group`` (nothing is exchanged when the layout is contiguous).

    Args:
        x: ``[1, T_local, ...]``, this rank's tokens in ``boundaries``' layout (any dtype and trailing shape).
        boundaries: this rank's :class:`ShardedBoundaries`.

    Returns:
        ``[1, T_local, ...]``: row tokens ``[rank * T_local, (rank + 1) * T_local)``, the tokens
        ``boundaries.contiguous()`` describes. Differentiable (its backward is :func:`to_layout`'s exchange).
    """
    return _relayout(x, boundaries, boundaries.layout, "contiguous")


def to_layout(x: torch.Tensor, boundaries: ShardedBoundaries) -> torch.Tensor:
    """This rank's tokens under ``boundaries.layout``, from its tokens under the contiguous layout: the
    inverse of :func:`to_contiguous` (same arguments, ``x`` holding ``boundaries.contiguous()``'s tokens)."""
    return _relayout(x, boundaries, "contiguous", boundaries.layout)


def _per_token(value: Any, tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (1, tokens)


def on_contiguous(call: Callable[[dict[str, Any], ShardedBoundaries], Any], arguments: Mapping[str, Any],
                  boundaries: ShardedBoundaries) -> Any:
    """``call(arguments, boundaries.contiguous())`` with every per-token argument (a tensor ``[1, T_local, ...]``)
    moved to the contiguous layout, and every per-token tensor it returns (alone or in a tuple) moved back.

    A collective over ``boundaries.group``: every rank calls it with arguments of the same shapes.

    Raises:
        InputError: an argument whose name holds ``"state"`` is given (per-document initial or final states:
            under the zigzag layout a rank's documents are not the contiguous shard's).
    """
    for name, value in arguments.items():
        if "state" in name and value is not None and value is not False:
            raise InputError(f"{name}: per-document states are not available on the {boundaries.layout!r} layout "
                             "(a rank's documents differ from the contiguous shard's the op runs on); shard with "
                             "layout='contiguous' (shard_batch(batch, group, layout='contiguous')) to pass or "
                             "return them")
    tokens = boundaries.local.total_tokens
    moved = {name: to_contiguous(value, boundaries) if _per_token(value, tokens) else value
             for name, value in arguments.items()}
    result = call(moved, boundaries.contiguous())

    def back(value: Any) -> Any:
        return to_layout(value, boundaries) if _per_token(value, tokens) else value

    return tuple(back(value) for value in result) if isinstance(result, tuple) else back(result)
