"""A shard's tokens moved between layouts, differentiably, and an op run on the contiguous layout (docs/parallel.md).

The recurrent ops (Gated DeltaNet, the SSD) pass state from rank to rank along the row, which needs each
rank to hold one contiguous piece: under the zigzag layout they run on the contiguous layout, as
Megatron-LM runs Gated DeltaNet. :func:`to_contiguous` sends every token of ``[1, T_local, ...]`` tensors
to the rank holding it under the contiguous layout (point to point, a local copy where that is this rank;
:mod:`hybrid_pack.ops.cp.exchange`), :func:`to_layout` sends them back; each one's backward is the other's
exchange. Several tensors move in one round of messages (one per peer, whatever their number and dtypes).
:func:`on_contiguous` runs a call on relayouted per-token arguments and relayouts its per-token outputs back:
one round in, one round out, and as many in the backward. Bytes sent per rank: the tokens it holds that
another rank holds under the other layout (``T_local / 2`` tokens' worth of every tensor from zigzag to
contiguous on 2 ranks or more).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries, layout_chunks
from hybrid_pack.errors import InputError
from hybrid_pack.ops.cp.exchange import TokenExchange, exchange_tokens_together, plan_exchange

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


def _relayout(tensors: Sequence[torch.Tensor], boundaries: ShardedBoundaries, source: str,
              target: str) -> tuple[torch.Tensor, ...]:
    """Every tensor of ``tensors`` (``[1, T_local, ...]`` each) moved from ``source`` to ``target``, in one round."""
    if source == target or not tensors:
        return tuple(tensors)
    tokens = boundaries.local.total_tokens
    for x in tensors:
        if x.dim() < 2 or tuple(x.shape[:2]) != (1, tokens):
            raise InputError(f"x: expected this rank's tokens [1, {tokens}, ...]; got shape {list(x.shape)}")
    moved = exchange_tokens_together([x[0] for x in tensors], relayout_plan(boundaries, source, target),
                                     boundaries.group)
    return tuple(x.unsqueeze(0) for x in moved)


def to_contiguous(*tensors: torch.Tensor, boundaries: ShardedBoundaries) -> tuple[torch.Tensor, ...]:
    """This rank's tokens under the contiguous layout, from its tokens under ``boundaries.layout``, for every
    tensor given, in one round of messages.

    A collective over ``boundaries.group`` (nothing is exchanged when the layout is contiguous): every rank
    passes tensors of the same dtypes and trailing shapes, in the same order.

    Args:
        tensors: ``[1, T_local, ...]`` each, this rank's tokens in ``boundaries``' layout (any dtypes and
            trailing shapes).
        boundaries: this rank's :class:`ShardedBoundaries`.

    Returns:
        ``[1, T_local, ...]`` each: row tokens ``[rank * T_local, (rank + 1) * T_local)``, the tokens
        ``boundaries.contiguous()`` describes. Differentiable (the backward is :func:`to_layout`'s exchange, one
        round for all of them).
    """
    return _relayout(tensors, boundaries, boundaries.layout, "contiguous")


def to_layout(*tensors: torch.Tensor, boundaries: ShardedBoundaries) -> tuple[torch.Tensor, ...]:
    """This rank's tokens under ``boundaries.layout``, from its tokens under the contiguous layout: the
    inverse of :func:`to_contiguous` (same arguments, each tensor holding ``boundaries.contiguous()``'s tokens)."""
    return _relayout(tensors, boundaries, "contiguous", boundaries.layout)


def _per_token(value: Any, tokens: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (1, tokens)


def on_contiguous(call: Callable[[dict[str, Any], ShardedBoundaries], Any], arguments: Mapping[str, Any],
                  boundaries: ShardedBoundaries) -> Any:
    """``call(arguments, boundaries.contiguous())`` with every per-token argument (a tensor ``[1, T_local, ...]``)
    moved to the contiguous layout, all in one round of messages, and every per-token tensor it returns (alone
    or in a tuple) moved back in one round; the backward also takes one round each way.

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
    names = [name for name, value in arguments.items() if _per_token(value, tokens)]
    moved = dict(arguments)
    moved.update(zip(names, to_contiguous(*(arguments[name] for name in names), boundaries=boundaries),
                     strict=True))
    result = call(moved, boundaries.contiguous())
    outputs = list(result) if isinstance(result, tuple) else [result]
    back = [i for i, value in enumerate(outputs) if _per_token(value, tokens)]
    for i, value in zip(back, to_layout(*(outputs[i] for i in back), boundaries=boundaries), strict=True):
        outputs[i] = value
    return tuple(outputs) if isinstance(result, tuple) else outputs[0]
