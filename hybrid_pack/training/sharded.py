"""``hybrid-pack train --fsdp``: the model sharded with FSDP2, checkpoints with ``torch.distributed.checkpoint``.

Every decoder block and the root are sharded over all ranks (:func:`hybrid_pack.parallel.fsdp.apply_fsdp`),
in bf16 mixed precision where the device has it (CUDA; on CPU the run stays float32). A checkpoint is a
directory: the sharded model and optimizer states written by every rank through DCP (``get_state_dict`` /
``set_state_dict``), and each rank's run state (schedule, its sampler
position, the stats, its random state) in ``rank<r>.pt``. A resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import shutil
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from hybrid_pack.distributed import agree_max
from hybrid_pack.errors import InputError
from hybrid_pack.packing.sampler import PackedBatchSampler
from hybrid_pack.parallel.fsdp import apply_fsdp, mixed_precision
from hybrid_pack.training.checkpoint import CheckpointSaver, restore_run_state, run_state
from hybrid_pack.training.stats import RunStats

__all__ = ["SHARDED_CHECKPOINT", "ShardedCheckpointSaver", "load_sharded_checkpoint", "parameters_checksum",
           "save_sharded_checkpoint", "shard_model", "unsharded_model"]

SHARDED_CHECKPOINT = "checkpoint"
"""The checkpoint directory in the run directory."""


def shard_model(model: torch.nn.Module, device: torch.device, world: int) -> dict[str, str]:
    """Shard ``model`` in place with FSDP2 over the ``world`` ranks; returns what ``metrics.json`` records of it:
    the compute ``dtype`` and the ``mixed_precision`` applied (none on CPU)."""
    if world < 2 or not dist.is_initialized():
        raise InputError("fsdp: shards the model across the ranks of a torchrun launch; run "
                         "`torchrun --nproc_per_node N -m hybrid_pack.cli train --fsdp ...` (N >= 2)")
    policy = mixed_precision(device)
    apply_fsdp(model, init_device_mesh(device.type, (world,)), mp_policy=policy)
    if policy is None:
        return {"dtype": "float32", "mixed_precision": f"none: {device.type} has no bf16 FSDP2 mixed precision here"}
    return {"dtype": "bfloat16", "mixed_precision": "bf16 parameters and compute, float32 gradient reduction"}


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


def save_sharded_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                            sampler: PackedBatchSampler, step: int, stats: RunStats) -> None:
    """Every rank writes its shards and run state to ``path.tmp``, then rank 0 renames it to ``path``."""
    tmp = path.with_suffix(".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
    torch.save(run_state(scheduler, sampler, step, stats), tmp / f"rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    dist.barrier()


def load_sharded_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                            sampler: PackedBatchSampler) -> tuple[int, RunStats]:
    """Restore a checkpoint :func:`save_sharded_checkpoint` wrote; return the step to continue from and the stats."""
    run_file = path / f"rank{dist.get_rank()}.pt"
    if agree_max([float(not run_file.is_file())])[0]:  # every rank raises, or none: the others would wait in load
        raise InputError(f"resume: no sharded checkpoint for every rank at {path} (rank<r>.pt); train with --fsdp "
                         "without --resume first, on as many ranks")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return restore_run_state(torch.load(run_file, weights_only=False), scheduler, sampler)


class ShardedCheckpointSaver(CheckpointSaver):
    """:class:`CheckpointSaver` for a sharded model: every rank takes part in each save."""

    def __call__(self, step: int) -> None:
        if (self.every and step % self.every == 0) or step == self.last_step:
            save_sharded_checkpoint(self.path, self.model, self.optimizer, self.scheduler, self.sampler, step,
                                    self.stats)
