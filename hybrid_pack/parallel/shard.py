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

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import LAYOUTS, ShardedBoundaries
from hybrid_pack.boundaries.targets import shift_labels
from hybrid_pack.distributed import share_objects
from hybrid_pack.errors import BoundaryError, InputError
from hybrid_pack.schema import (
    BOUNDARIES,
    BOUNDARY_KEYS,
    HOST_BOUNDARIES,
    IGNORE_INDEX,
    IMAGE_GRID_THW,
    INPUT_IDS,
    INPUTS_EMBEDS,
    LABELS,
    NUM_ITEMS_IN_BATCH,
    PIXEL_VALUES,
    PIXEL_VALUES_VIDEOS,
    POSITION_IDS,
    SHIFT_LABELS,
    VIDEO_GRID_THW,
)

__all__ = ["LAYOUTS", "shard_batch"]


def shard_batch(batch: Mapping[str, Any], group: Any = None, *, layout: str = "contiguous",
                check_ranks: bool = True) -> dict[str, Any]:
    """This rank's part of a packed batch (a :class:`~hybrid_pack.PackingCollator` output, one row).

    Args:
        batch: the whole row, identical on every rank of ``group``: ``input_ids`` (or ``inputs_embeds``)
            ``[1, T]``, its boundary keys (or ``boundaries``), ``labels`` and any other per-token keys.
        group: the context-parallel process group, or a one-dimensional ``DeviceMesh`` (None: the world; one
            process without torch.distributed).
        layout: ``"contiguous"`` or ``"zigzag"`` (the row's length must then divide by ``2 * R``).
        check_ranks: compare the row across the group's ranks first (one small collective: its length, layout,
            documents' lengths and, for tokens on the host, a digest of them), so that ranks given different rows
            raise instead of hanging in a kernel's exchange or training on a row no rank holds.

    Returns:
        A dict the models take (``model(**shard_batch(batch, group))``): every per-token tensor (shape
        ``[1, T, ...]``) sliced to this rank's ``T / R`` tokens (in its layout's order), ``boundaries``
        (:class:`ShardedBoundaries`), and with labels, ``shift_labels`` (sliced after shifting on the row) and
        ``num_items_in_batch`` (the row's target count, an int64 tensor; kept when the batch gives it). M-RoPE
        ``position_ids`` ``[3, 1, T]`` are sliced along their tokens.

    Raises:
        InputError: several rows, a row length not divisible by the group's size (twice it for zigzag), an
            unknown layout, images or videos (a vision tower has no context-parallel path), a ``group`` that is
            neither a process group nor a one-dimensional mesh, or (``check_ranks``) ranks given different rows.
        BoundaryError: boundaries whose token count is not the row's.
    """
    group = _process_group(group)
    if dist.is_initialized():
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    elif group is not None:
        raise InputError("group: given, but torch.distributed is not initialised; call init_process_group first")
    else:
        rank, world_size = 0, 1
    tokens_key, tokens, row, refusal = _local_row(batch, layout)
    if check_ranks and world_size > 1:  # every rank raises, or none: a rank left alone would wait in a collective
        _refuse_different_rows(tokens_key, tokens, row, layout, group, rank, refusal)
    elif refusal is not None:
        raise refusal
    shard = ShardedBoundaries.from_row(row, group=group, rank=rank, world_size=world_size, layout=layout)
    total = row.total_tokens

    out: dict[str, Any] = {}
    for key, value in batch.items():
        if _per_token(value, total):
            out[key] = shard.take(value)
        elif key == POSITION_IDS and isinstance(value, torch.Tensor) and tuple(value.shape) == (3, 1, total):
            out[key] = shard.take(value.transpose(1, 2)).transpose(1, 2)  # M-RoPE's [3, 1, T]
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


def _process_group(group: Any) -> Any:
    """The process group of ``group``: itself, or a one-dimensional ``DeviceMesh``'s."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise InputError(f"group: expected the context-parallel dimension of the mesh (mesh['cp']); got a "
                             f"{group.ndim}-D mesh {group.mesh_dim_names}")
        return group.get_group()
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise InputError(f"group: expected a process group (dist.new_group(ranks)) or mesh['cp']; got "
                         f"{type(group).__name__}")
    return group


def _local_row(batch: Mapping[str, Any], layout: str
               ) -> tuple[str, torch.Tensor | None, PackedBoundaries | None, InputError | None]:
    """``(tokens key, tokens, the row's boundaries, why this rank cannot shard it)``: the checks that need no other
    rank, returned, not raised, so that every rank learns of a refusal before any raises (the row None then)."""
    tokens_key = INPUT_IDS if batch.get(INPUT_IDS) is not None else INPUTS_EMBEDS
    tokens = batch.get(tokens_key)
    try:
        if layout not in LAYOUTS:
            raise InputError(f"layout: expected one of {LAYOUTS}; got {layout!r}")
        if tokens is None or tokens.dim() < 2 or tokens.shape[0] != 1:
            got = "nothing" if tokens is None else f"shape {list(tokens.shape)}"
            raise InputError(f"{tokens_key}: expected one packed row [1, T] (PackingCollator builds one row per "
                             f"batch; shard each row on its own); got {got}")
        given = batch.get(BOUNDARIES)
        if isinstance(given, ShardedBoundaries):
            raise InputError(f"{BOUNDARIES}: this batch is already one rank's shard; shard the whole row once")
        if given is not None and not isinstance(given, PackedBoundaries):
            raise InputError(f"{BOUNDARIES}: expected the whole row's PackedBoundaries; got {type(given).__name__}")
        row = PackedBoundaries.from_batch(batch) if given is None else given
    except InputError as error:
        return tokens_key, tokens, None, error
    return tokens_key, tokens, row, _refusal(batch, row, tokens)


def _refusal(batch: Mapping[str, Any], row: PackedBoundaries, tokens: torch.Tensor) -> InputError | None:
    """What this rank's row cannot be sharded for (boundaries of another row, images or videos), or None."""
    if row.total_tokens != tokens.shape[1]:
        return BoundaryError(f"{BOUNDARIES}: describe {row.total_tokens} tokens; the row has {tokens.shape[1]}")
    for key in (PIXEL_VALUES, PIXEL_VALUES_VIDEOS, IMAGE_GRID_THW, VIDEO_GRID_THW):
        value = batch.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or value.numel()):
            return InputError(f"{key}: a row with images or videos cannot be split across a context-parallel group "
                              "(the vision tower and the image tokens' placement need the whole row); train such "
                              "rows without context parallelism")
    return None


def _refuse_different_rows(tokens_key: str, tokens: torch.Tensor | None, row: PackedBoundaries | None, layout: str,
                           group: Any, rank: int, refusal: InputError | None) -> None:
    """Raise on every rank when one rank refused its row (``refusal``; ``row`` None when it has none) or the
    group's ranks were given different rows (one small collective)."""
    if refusal is not None:
        mine: tuple[Any, ...] = (None, layout, None, None, str(refusal))
    else:
        digest = None
        if tokens.device.type == "cpu":  # a digest of tokens on an accelerator would read them back: lengths only
            digest = hashlib.blake2b(tokens.detach().contiguous().view(torch.uint8).numpy().tobytes(),
                                     digest_size=8).hexdigest()
        lengths = hashlib.blake2b(repr(row.lengths).encode(), digest_size=8).hexdigest()
        mine = (int(tokens.shape[1]), layout, lengths, digest, None)
    rows = share_objects(mine, group)
    if refusal is not None:
        raise refusal
    refused = next(((r, theirs[4]) for r, theirs in enumerate(rows) if theirs[4] is not None), None)
    if refused is not None:
        raise InputError(f"{tokens_key}: group rank {refused[0]} of the context-parallel group refused its row "
                         f"({refused[1]}); every rank stops with it")
    differ = [r for r, theirs in enumerate(rows) if theirs[:3] != mine[:3]
              or (None not in (theirs[3], mine[3]) and theirs[3] != mine[3])]
    if differ:
        raise InputError(f"{tokens_key}: every rank of the context-parallel group must be given the same whole row "
                         f"(its tokens, lengths and layout); group rank {rank}'s differs from group ranks {differ}'s: "
                         "draw each step's batch once per data-parallel replica (a DistributedSampler over the "
                         "data-parallel ranks, not the world), then shard it")
