"""One rank's part of a packed batch whose row is split across a context-parallel group (docs/api.md §10).

Token order: ``layout="contiguous"``, rank ``r`` of ``R`` holds row tokens ``[r*T/R, (r+1)*T/R)``;
``layout="zigzag"``, the row is cut into ``2R`` chunks and rank ``r`` holds chunks ``r`` and ``2R-1-r``, in
that order (:data:`~hybrid_pack.boundaries.sharded.LAYOUTS`). Every per-token key is sliced; the boundary
keys that describe the whole row (``cu_seq_lens_*``, ``max_length_*``, ``num_pad_tokens``) are replaced by
``boundaries``, a :class:`ShardedBoundaries`.

The next-token loss of a rank's last token needs the first label of the next rank, so the labels are
also shifted on the whole row before slicing (``shift_labels``: the target of position ``t`` at ``t``)
and ``num_items_in_batch`` counts the whole row's targets: each rank's loss is then its share, and the
shares (and their gradients) sum over the group to the unsharded row's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import LAYOUTS, ShardedBoundaries
from hybrid_pack.boundaries.targets import shift_labels
from hybrid_pack.errors import InputError
from hybrid_pack.schema import (
    BOUNDARIES,
    BOUNDARY_KEYS,
    HOST_BOUNDARIES,
    IGNORE_INDEX,
    INPUT_IDS,
    INPUTS_EMBEDS,
    LABELS,
    NUM_ITEMS_IN_BATCH,
    SHIFT_LABELS,
)

__all__ = ["LAYOUTS", "shard_batch"]


def shard_batch(batch: Mapping[str, Any], group: Any = None, *, layout: str = "contiguous") -> dict[str, Any]:
    """This rank's part of a packed batch (a :class:`~hybrid_pack.PackingCollator` output, one row).

    Args:
        batch: the whole row, identical on every rank of ``group``: ``input_ids`` (or ``inputs_embeds``)
            ``[1, T]``, its boundary keys (or ``boundaries``), ``labels`` and any other per-token keys.
        group: the context-parallel process group (None: the world; one process without torch.distributed).
        layout: ``"contiguous"`` or ``"zigzag"`` (the row's length must then divide by ``2 * R``).

    Returns:
        A dict the models take (``model(**shard_batch(batch, group))``): every per-token tensor (shape
        ``[1, T, ...]``) sliced to this rank's ``T / R`` tokens (in its layout's order), ``boundaries``
        (:class:`ShardedBoundaries`), and with labels, ``shift_labels`` (sliced after shifting on the row) and
        ``num_items_in_batch`` (the row's target count, an int64 tensor; kept when the batch gives it).

    Raises:
        InputError: several rows, a row length not divisible by the group's size (twice it for zigzag), an
            unknown layout.
    """
    if layout not in LAYOUTS:
        raise InputError(f"layout: expected one of {LAYOUTS}; got {layout!r}")
    tokens_key = INPUT_IDS if batch.get(INPUT_IDS) is not None else INPUTS_EMBEDS
    tokens = batch.get(tokens_key)
    if tokens is None or tokens.dim() < 2 or tokens.shape[0] != 1:
        got = "nothing" if tokens is None else f"shape {list(tokens.shape)}"
        raise InputError(f"{tokens_key}: expected one packed row [1, T] (PackingCollator builds one row per batch; "
                         f"shard each row on its own); got {got}")
    given = batch.get(BOUNDARIES)
    if isinstance(given, ShardedBoundaries):
        raise InputError(f"{BOUNDARIES}: this batch is already one rank's shard; shard the whole row once")
    if given is not None and not isinstance(given, PackedBoundaries):
        raise InputError(f"{BOUNDARIES}: expected the whole row's PackedBoundaries; got {type(given).__name__}")
    row = PackedBoundaries.from_batch(batch) if given is None else given
    if dist.is_initialized():
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    elif group is not None:
        raise InputError("group: given, but torch.distributed is not initialised; call init_process_group first")
    else:
        rank, world_size = 0, 1
    shard = ShardedBoundaries.from_row(row, group=group, rank=rank, world_size=world_size, layout=layout)
    total = row.total_tokens

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if _per_token(value, total):
            out[key] = shard.take(value)
        elif key not in (*BOUNDARY_KEYS, HOST_BOUNDARIES, BOUNDARIES):  # the row's boundaries: the shard's instead
            out[key] = value
    if batch.get(LABELS) is not None:
        shifted = shift_labels(batch[LABELS], row)
        out[SHIFT_LABELS] = shard.take(shifted)
        if batch.get(NUM_ITEMS_IN_BATCH) is None:
            out[NUM_ITEMS_IN_BATCH] = (shifted != IGNORE_INDEX).sum()
    out[BOUNDARIES] = shard
    return out


def _per_token(value: Any, total: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (1, total)
