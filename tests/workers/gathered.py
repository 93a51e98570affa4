"""What the context-parallel workers compare with the unsharded row: every rank's pieces put back together."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid_pack.parallel import ShardedBoundaries


def gather_tokens(local: torch.Tensor, shard: ShardedBoundaries) -> torch.Tensor:
    """Every rank's tokens ``[1, T/R, ...]`` (its chunks in its layout's order) -> the row ``[1, T, ...]``."""
    pieces = [torch.empty_like(local) for _ in range(shard.world_size)]
    dist.all_gather(pieces, local.detach().contiguous())
    row = local.new_empty(1, shard.row.total_tokens, *local.shape[2:])
    for rank, piece in enumerate(pieces):
        at = 0
        for start, length in shard.chunks_of(rank):
            row[:, start:start + length] = piece[:, at:at + length]
            at += length
    return row


def summed(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over the ranks (a detached copy)."""
    value = value.detach().clone()
    dist.all_reduce(value)
    return value
