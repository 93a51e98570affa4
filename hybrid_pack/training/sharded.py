"""``hybrid-pack train --fsdp``: the model sharded with FSDP2, checkpoints with ``torch.distributed.checkpoint``.

Every decoder block and the root are sharded over all ranks (:func:`hybrid_pack.parallel.parallelize`),
in bf16 mixed precision where the device has it (CUDA; on CPU the run stays float32). A checkpoint is a step
folder (``OUT/checkpoint/step-N/``, laid out and committed as :mod:`hybrid_pack.training.checkpoint` describes):
the sharded model and optimizer states written by every rank through DCP (``get_state_dict`` /
``set_state_dict``), and each rank's run state (schedule, its sampler position, the stats, its random state) in
``rank<r>.pt``. Nothing in it is unpickled beyond tensors, plain values and DCP's own records
(:mod:`hybrid_pack.training.dcp_reader`). A resumed run
continues exactly where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hybrid_pack.distributed import gather_rows
from hybrid_pack.errors import InputError
from hybrid_pack.packing.sampler import PackedBatchSampler
from hybrid_pack.parallel.fsdp import mixed_precision
from hybrid_pack.parallel.parallelize import parallelize
from hybrid_pack.training.checkpoint import (
    CheckpointSaver,
    agreed_checkpoint,
    commit_checkpoint,
    read_state,
    restore_run_state,
    run_state,
    save_state,
    staging_folder,
    start_checkpoint,
)
from hybrid_pack.training.dcp_reader import read_dcp, read_dcp_metadata
from hybrid_pack.training.stats import RunStats

__all__ = ["ShardedCheckpointSaver", "load_sharded_checkpoint", "parameters_checksum", "save_sharded_checkpoint",
           "shard_model", "unsharded_model"]


def shard_model(model: torch.nn.Module, device: torch.device, world: int, *, mesh: DeviceMesh | None = None,
                activation_checkpointing: bool = False, compile: bool = False) -> dict[str, str]:
    """Shard ``model`` in place with FSDP2 over the ``world`` ranks (``mesh``, the run's ``("dp", "cp")`` mesh,
    flattened; None: the world), after wrapping its blocks for activation checkpointing and compiling them if
    asked (:func:`hybrid_pack.parallel.parallelize`); returns what ``metrics.json`` records of it: the compute
    ``dtype``, the ``mixed_precision`` applied (none on CPU) and the ``mesh`` sharded over."""
    if world < 2 or not dist.is_initialized():
        raise InputError("fsdp: shards the model across the ranks of a torchrun launch; run "
                         "`torchrun --nproc_per_node N -m hybrid_pack.cli train --fsdp ...` (N >= 2)")
    policy = mixed_precision(device)
    parallelize(model, mesh=mesh, fsdp=True, activation_checkpointing=activation_checkpointing, compile=compile,
                mp_policy=policy)
    sharded_over = f"{world} ranks" + ("" if mesh is None else f" (the {'x'.join(mesh.mesh_dim_names)} mesh "
                                                                f"{tuple(mesh.shape)} flattened)")
    if policy is None:
        return {"dtype": "float32", "mixed_precision": f"none: {device.type} has no bf16 FSDP2 mixed precision here",
                "mesh": sharded_over}
    return {"dtype": "bfloat16", "mixed_precision": "bf16 parameters and compute, float32 gradient reduction",
            "mesh": sharded_over}


def unsharded_model(model: torch.nn.Module, build: Callable[[], torch.nn.Module], rank: int
                    ) -> torch.nn.Module | None:
    """The sharded ``model``'s full weights in a plain copy made by ``build()``, on rank 0 (None elsewhere).

    A collective: every rank calls it. The full state dict is gathered to rank 0's host memory only.
    """
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    plain = build()
    plain.load_state_dict(state)
    return plain


def parameters_checksum(model: torch.nn.Module) -> float:
    """The sum of every parameter (float64), its shards summed over the ranks for a sharded model."""
    local = sum(float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum())
                for p in model.parameters())
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return local
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total)


def save_sharded_checkpoint(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                            sampler: PackedBatchSampler, step: int, stats: RunStats) -> None:
    """Every rank writes its shards and run state to ``root/step-N.tmp/``; then rank 0 renames it to ``step-N/``
    and points ``latest`` at it (:func:`~hybrid_pack.training.checkpoint.commit_checkpoint`). A collective."""
    rank = dist.get_rank()
    if rank == 0:
        start_checkpoint(root, step)
    dist.barrier()
    staging = staging_folder(root, step)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging)
    save_state(staging / f"rank{rank}.pt", run_state(scheduler, sampler, step, stats))
    dist.barrier()
    if rank == 0:
        commit_checkpoint(root, step)
    dist.barrier()


def load_sharded_checkpoint(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                            sampler: PackedBatchSampler) -> tuple[int, RunStats]:
    """Restore the checkpoint ``latest`` names under ``root`` (every rank the one rank 0 chose), every file read
    as tensors and plain values only; return the step to continue from and the stats. A collective."""
    folder = agreed_checkpoint(root)
    rank = dist.get_rank()
    run_file = folder / f"rank{rank}.pt"
    try:  # every rank raises, or none: the others would wait in dcp.load
        if not run_file.is_file():
            raise InputError(f"resume: {folder} holds no run state for rank {rank} ({run_file.name}); resume with "
                             "--fsdp on as many ranks as the run that wrote it")
        run = read_state(run_file)
        read_dcp_metadata(folder)
    except InputError as err:
        refused = err
    else:
        refused = None
    failed = [r for r, (flag,) in enumerate(gather_rows([float(refused is not None)])) if flag]
    if refused is not None:
        raise refused
    if failed:
        raise InputError(f"resume: the checkpoint {folder} was refused on rank(s) {failed} (their errors say why)")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    read_dcp(state, folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return restore_run_state(run, scheduler, sampler)


class ShardedCheckpointSaver(CheckpointSaver):
    """:class:`CheckpointSaver` for a sharded model: every rank takes part in each save."""

    def __call__(self, step: int) -> None:
        if (self.every and step % self.every == 0) or step == self.last_step:
            save_sharded_checkpoint(self.path, self.model, self.optimizer, self.scheduler, self.sampler, step,
                                    self.stats)
