"""Checkpoints of a packed run: model, optimizer, scheduler, the sampler's position and the stats so far.

A run resumed from one sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from hybrid_pack.errors import InputError
from hybrid_pack.packing.sampler import PackedBatchSampler
from hybrid_pack.training.stats import RunStats

CHECKPOINT = "checkpoint.pt"


def run_state(scheduler: Any, sampler: PackedBatchSampler, step: int, stats: RunStats) -> dict[str, Any]:
    """What a checkpoint holds beside the model and optimizer: the schedule, this rank's sampler position, the
    step, the stats so far and the CPU random state."""
    return {"scheduler": scheduler.state_dict(), "sampler": sampler.state_dict(), "step": step,
            "losses": stats.losses, "groups": stats.groups, "real_tokens": stats.real_tokens,
            "computed_tokens": stats.computed_tokens, "seconds": stats.seconds,
            "warmup_seconds": stats.warmup_seconds, "warmup_tokens": stats.warmup_tokens,
            "rng": torch.get_rng_state()}


def restore_run_state(ckpt: dict[str, Any], scheduler: Any, sampler: PackedBatchSampler) -> tuple[int, RunStats]:
    """Put back what :func:`run_state` saved; return the step to continue from and the stats so far."""
    scheduler.load_state_dict(ckpt["scheduler"])
    sampler.load_state_dict(ckpt["sampler"])
    if "rng" in ckpt:
        torch.set_rng_state(ckpt["rng"].cpu())
    stats = RunStats(losses=list(ckpt["losses"]), groups=list(ckpt["groups"]), real_tokens=ckpt["real_tokens"],
                     computed_tokens=ckpt["computed_tokens"], seconds=ckpt["seconds"],
                     warmup_seconds=ckpt["warmup_seconds"], warmup_tokens=ckpt["warmup_tokens"])
    return ckpt["step"], stats


def save_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    sampler: PackedBatchSampler, step: int, stats: RunStats) -> None:
    """Write the checkpoint of optimizer step ``step`` atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                **run_state(scheduler, sampler, step, stats)}, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    sampler: PackedBatchSampler, device: torch.device) -> tuple[int, RunStats]:
    """Restore the states saved at ``path`` in place; return the step to continue from and the stats so far."""
    if not path.is_file():
        raise InputError(f"resume: no checkpoint at {path}; train without --resume first")
    ckpt = torch.load(path, map_location=device, weights_only=False)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    return restore_run_state(ckpt, scheduler, sampler)


class CheckpointSaver:
    """Called after every optimizer step: saves every ``every`` steps (0: never) and after ``last_step``, on rank 0."""

    def __init__(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 sampler: PackedBatchSampler, stats: RunStats, *, every: int, last_step: int, rank: int) -> None:
        self.path, self.model, self.optimizer, self.scheduler, self.sampler, self.stats = (
            path, model, optimizer, scheduler, sampler, stats)
        self.every, self.last_step, self.rank = every, last_step, rank

    def __call__(self, step: int) -> None:
        due = self.every and step % self.every == 0
        if self.rank == 0 and (due or step == self.last_step):
            save_checkpoint(self.path, self.model, self.optimizer, self.scheduler, self.sampler, step, self.stats)
