"""Checks of a sharded model agree across its process group (docs/api.md §7b).

When a model's forward is a collective (FSDP2, FSDP1, DeepSpeed ZeRO-3), every rank must run the same
sequence of forwards, whatever documents its own packed row holds; and a verdict reached on one rank must
be reached on all, or the others wait forever at the next collective. These helpers find the group a
model's forwards run on and make a check's run count and verdict the same on every rank of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["agree_max", "gather_rows", "global_rank", "model_group", "share_object"]

Group = Any
"""A ``torch.distributed.ProcessGroup`` (``dist.group.WORLD`` included)."""


def model_group(model: nn.Module, group: Group | None = None) -> Group | None:
    """The process group whose ranks must run ``model``'s checks together, or None (each rank checks alone).

    ``group`` when given; else, once a process group is initialised: an FSDP2 module's mesh (the world for a
    mesh of several dimensions), an FSDP1 module's or a ``DistributedDataParallel`` wrapper's process group (a
    DDP forward is local, but a rank raising alone leaves the others waiting in the backward), the world for
    DeepSpeed ZeRO-3 parameters (``ds_id``); None for an unsharded model or a group of one rank.
    """
    if group is None and dist.is_available() and dist.is_initialized():
        group = _sharding_group(model)
    if group is None or dist.get_world_size(group) == 1:
        return None
    return group


def _sharding_group(model: nn.Module) -> Group | None:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.process_group
    for module in model.modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            if groups:
                mesh = groups[0].mesh_info.mesh
                return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
        if isinstance(module, FullyShardedDataParallel):
            return module.process_group
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return dist.group.WORLD
    return None


def _device(group: Group) -> torch.device:
    """Where the group's collectives take tensors (NCCL: the current CUDA device)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_max(values: Sequence[float], group: Group) -> list[float]:
    """Each value's maximum over the ranks of ``group`` (one ``all_reduce``)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def gather_rows(values: Sequence[float], group: Group) -> list[list[float]]:
    """Every rank's ``values`` (the same length on each), in group rank order (one ``all_gather``)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=_device(group))
    rows = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, tensor, group=group)
    return [row.tolist() for row in rows]


def share_object(value: Any, source: int, group: Group) -> Any:
    """``value`` as the rank of group rank ``source`` holds it, on every rank."""
    values: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values[source]


def global_rank(group: Group, group_rank: int) -> int:
    """The world rank of ``group``'s rank ``group_rank`` (what ``RANK`` says in that process)."""
    return dist.get_global_rank(group, group_rank)
