"""Small collectives over a ``torch.distributed`` process group, for decisions every rank must share.

Used by every layer that must decide the same on every rank: the backends' warm-up, which settles one
self-check verdict per key for the group (``ops/dispatch/warmup.py``), and the guard's run counts and verdicts
(``testing/guard.py``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Group", "agree_max", "distributed", "end_process_group", "gather_rows", "share_objects"]

Group = Any
"""A ``torch.distributed.ProcessGroup`` (``dist.group.WORLD`` included)."""


def distributed() -> bool:
    """Whether a process group of more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device(group: Group | None) -> torch.device:
    """Where the group's collectives take tensors (NCCL: the current CUDA device)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_max(values: Sequence[float], group: Group | None = None) -> list[float]:
    """Each value's maximum over the ranks of ``group`` (None: the world), in one ``all_reduce``."""
    tensor = torch.tensor(values, dtype=torch.float64, device=_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def gather_rows(values: Sequence[float], group: Group | None = None) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), in group rank order, in one ``all_gather``."""
    tensor = torch.tensor(values, dtype=torch.float64, device=_device(group))
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, tensor, group=group)
    return [row.tolist() for row in rows]


def share_objects(value: Any, group: Group | None = None) -> list[Any]:
    """Every rank's ``value`` (any picklable object), in group rank order."""
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def end_process_group() -> None:
    """End the default process group (if one is open) on every rank, after a barrier.

    Without the barrier gloo can abort the process at exit ("terminate called without an active exception") or
    deadlock in its destructor: its worker thread still frees the last collectives, which needs the GIL that the
    main thread holds while joining it. So after the barrier the main thread collects its garbage and then
    sleeps a moment, without the GIL, for gloo's threads to finish freeing. Call it only where every rank gets
    there (not while unwinding from an error on one rank).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    dist.barrier()
    gc.collect()
    time.sleep(0.2)
    dist.destroy_process_group()
