"""The device mesh of a context-parallel run: data-parallel replicas x context-parallel ranks (docs/parallel.md).

World rank ``w`` sits at ``(dp, cp) = (w // N, w % N)`` for a context-parallel size ``N``: the ``N``
consecutive ranks of one replica share each packed row (one shard each), the replicas draw different
rows. Gradients are all-reduced over the whole world: every rank's loss is its share of its row's.
FSDP2 shards the parameters over the same world, the mesh flattened (:func:`flattened`): handing
``fully_shard`` the 2-D mesh would replicate over ``"dp"`` and shard over ``"cp"`` only (HSDP).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybrid_pack.errors import InputError

__all__ = ["DP", "CP", "DP_CP", "context_parallel_mesh", "flattened", "world_mesh"]

DP, CP = "dp", "cp"
"""The mesh's dimension names."""
DP_CP = "dp_cp"
"""The name of the flattened mesh's one dimension."""


def context_parallel_mesh(context_parallel: int, device_type: str) -> DeviceMesh | None:
    """A ``("dp", "cp")`` mesh over the initialised world, or None for ``context_parallel == 1``.

    Raises:
        InputError: a size below 1, or one that does not divide the world (or no process group).
    """
    if context_parallel < 1:
        raise InputError(f"context_parallel: expected a positive int; got {context_parallel}")
    if context_parallel == 1:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % context_parallel:
        raise InputError(f"context_parallel: {context_parallel} does not divide the {world} processes; launch "
                         f"torchrun with --nproc_per_node a multiple of it")
    return init_device_mesh(device_type, (world // context_parallel, context_parallel), mesh_dim_names=(DP, CP))


def flattened(mesh: DeviceMesh) -> DeviceMesh:
    """A 1-D mesh over every rank of ``mesh``, in its order (``(dp, cp)`` -> world rank ``dp * N + cp``): the
    mesh FSDP2 shards over under context parallelism. A 1-D mesh is returned as it is.

    A collective on the world: every rank calls it (it makes the flat mesh's process group).
    """
    if mesh.ndim == 1:
        return mesh
    return DeviceMesh(mesh.device_type, mesh.mesh.flatten(), mesh_dim_names=(DP_CP,))


def world_mesh(device_type: str) -> DeviceMesh:
    """A 1-D mesh over every rank of the initialised world.

    Raises:
        InputError: no process group (start the run under torchrun).
    """
    if not dist.is_initialized():
        raise InputError("mesh: no torch.distributed process group; launch under torchrun (or call "
                         "init_process_group) before sharding")
    return init_device_mesh(device_type, (dist.get_world_size(),))
