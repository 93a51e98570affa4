"""Checks of a sharded model agree across its process group (docs/api.md §7b).

When a model's forward is a collective (FSDP2, FSDP1, DeepSpeed ZeRO-3), every rank must run the same
sequence of forwards, whatever documents its own packed row holds; and a verdict reached on one rank must
be reached on all, or the others wait forever at the next collective. :func:`model_group` finds the group
a model's forwards run on; the guard agrees on it with :mod:`hybrid_pack.distributed`'s collectives.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybrid_pack.distributed import Group

__all__ = ["model_group"]


def model_group(model: nn.Module, group: Group | None = None) -> Group | None:
    """The process group whose ranks must run ``model``'s checks together, or None (each rank checks alone).

    ``group`` when given; else, once a process group is initialised: for FSDP2 the mesh of its sharded
    parameters (DTensors; the world for a mesh of several dimensions, or while no parameter is sharded, between
    an unsharding forward and its backward), an FSDP1 module's or a ``DistributedDataParallel`` wrapper's process
    group (a DDP forward is local, but a rank raising alone leaves the others waiting in the backward), the world
    for DeepSpeed ZeRO-3 parameters (``ds_id``); None for an unsharded model or a group of one rank.
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
    modules = list(model.modules())
    if any(isinstance(module, FSDPModule) for module in modules):
        mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
        return mesh.get_group() if mesh is not None and mesh.ndim == 1 else dist.group.WORLD
    for module in modules:
        if isinstance(module, FullyShardedDataParallel):
            return module.process_group
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return dist.group.WORLD
    return None
