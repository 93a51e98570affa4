"""Checkpoints of a packed run: model, optimizer, scheduler, the sampler's position and the stats so far.

A run resumed from one sees exactly the batches the uninterrupted run would have seen. On disk, under the run's
checkpoint root (``OUT/checkpoint/``)::

    step-000004/    a complete checkpoint (one process: state.pt; FSDP: DCP's files and rank<r>.pt)
    step-000006/
    latest          the name of the folder to resume from ("step-000006"), written last

A save writes ``step-N.tmp/``, renames it to ``step-N/``, replaces ``latest`` (a temporary file, then a rename),
and only then removes the older folders beyond the last :data:`KEEP`; so a process killed at any moment leaves
``latest`` naming a complete folder. Every file is loaded with ``torch.load(..., weights_only=True)``: tensors and
plain values only, never an arbitrary object.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.distributed import agree_max, share_objects
from hybrid_pack.errors import InputError
from hybrid_pack.packing.sampler import PackedBatchSampler
from hybrid_pack.training.stats import RunStats

__all__ = ["CHECKPOINT", "KEEP", "POINTER", "RANK_STATES", "STATE_FILE", "CheckpointSaver", "agreed_checkpoint",
           "commit_checkpoint", "latest_checkpoint", "load_checkpoint", "read_state", "refusal_reason",
           "restore_run_state", "run_state", "save_checkpoint", "save_state", "staging_folder", "start_checkpoint",
           "step_folder_name"]

CHECKPOINT = "checkpoint"
"""The checkpoint root in the run directory, for one process and for FSDP."""
POINTER = "latest"
"""The file in the root naming the step folder to resume from."""
STATE_FILE = "state.pt"
"""One process: the file of a step folder holding the model, optimizer and run state."""
RANK_STATES = "rank_states"
"""The key of :data:`STATE_FILE` holding every rank's run state, in rank order, when several ranks trained."""
KEEP = 2
"""Complete step folders kept: the newest and the one before it."""

_STEP = re.compile(r"step-(\d{6}|[1-9]\d{6,})")  # exactly what step_folder_name writes
_UNFINISHED = re.compile(rf"{_STEP.pattern}\.(tmp|old)")  # being written, or being removed
_NO_CHECKPOINT, _OLD_LAYOUT = -1, -2  # what rank 0 tells the others in place of a step


def step_folder_name(step: int) -> str:
    """``step-000004``: the folder of optimizer step ``step``."""
    return f"step-{step:06d}"


def staging_folder(root: Path, step: int) -> Path:
    """``step-N.tmp``: where step ``step``'s checkpoint is written before it is renamed into place."""
    return root / f"{step_folder_name(step)}.tmp"


# ------------------------------------------------------------------------------------ the folders on disk
def start_checkpoint(root: Path, step: int) -> Path:
    """An empty staging folder for step ``step`` (what a killed save left there is removed); returns it."""
    staging = staging_folder(root, step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit_checkpoint(root: Path, step: int, keep: int = KEEP) -> Path:
    """Rename step ``step``'s staging folder into place, point ``latest`` at it, then remove every other folder but
    the ``keep - 1`` newest complete ones before it; returns the step folder. One process calls it (rank 0)."""
    folder = root / step_folder_name(step)
    if folder.exists():  # left by an earlier run that got this far: not the one `latest` names after a resume
        _remove(folder)
    staging_folder(root, step).rename(folder)
    _sync_directory(root)
    pointer = root / f"{POINTER}.tmp"
    with open(pointer, "w") as file:
        file.write(folder.name + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(pointer, root / POINTER)
    _sync_directory(root)
    older = [path for number, path in _complete_folders(root) if number < step][-(keep - 1):] if keep > 1 else []
    for path in root.iterdir():
        ours = _STEP.fullmatch(path.name) or _UNFINISHED.fullmatch(path.name)
        if ours and path != folder and path not in older:
            _remove(path)
    return folder


def latest_checkpoint(root: Path) -> Path | None:
    """The step folder a resume loads: the one ``latest`` names, else (no pointer, or it names no complete folder)
    the newest complete one; None when there is none. Staging (``.tmp``) and half-removed folders never count.

    Raises:
        InputError: ``root`` holds only a checkpoint of the earlier layout (``OUT/checkpoint.pt``, or DCP's files
            directly in ``OUT/checkpoint/``), naming how to move it into a step folder.
    """
    pointer = root / POINTER
    named = pointer.read_text().strip() if pointer.is_file() else ""
    if _STEP.fullmatch(named) and (root / named).is_dir():
        return root / named
    folders = _complete_folders(root)
    if folders:
        return folders[-1][1]
    old_file, old_dir = root.parent / "checkpoint.pt", root / ".metadata"
    if old_file.is_file() or old_dir.is_file():
        moved = (f"move {old_file} to {root / step_folder_name(0) / STATE_FILE}" if old_file.is_file()
                 else f"move the files of {root} into {root / step_folder_name(0)}/")
        raise InputError(f"resume: {old_file if old_file.is_file() else root} is a checkpoint of the earlier layout "
                         f"(before step folders); {moved} and resume again")
    return None


def agreed_checkpoint(root: Path) -> Path:
    """:func:`latest_checkpoint` as rank 0 finds it, for every rank (a collective when a process group of more
    than one rank is up); rank 0 also removes what killed saves left. Raises on every rank, or on none."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    code, error = float("-inf"), None
    if rank == 0:
        try:
            folder = latest_checkpoint(root)
            code = _NO_CHECKPOINT if folder is None else int(_STEP.fullmatch(folder.name).group(1))
            if folder is not None:
                _remove_leftovers(root)
        except InputError as err:
            code, error = _OLD_LAYOUT, err
    if world > 1:
        code = agree_max([code])[0]
    if code == _OLD_LAYOUT:
        raise error or InputError(f"resume: {root} holds a checkpoint of the earlier layout (rank 0 says how to "
                                  "move it into a step folder)")
    if code == _NO_CHECKPOINT:
        raise InputError(f"resume: no complete checkpoint in {root} (step-<N>/ folders); train without --resume "
                         "first")
    return root / step_folder_name(int(code))


def _complete_folders(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete step folder in ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = ((_STEP.fullmatch(path.name), path) for path in root.iterdir())
    return sorted((int(match.group(1)), path) for match, path in found if match and path.is_dir())


def _remove(folder: Path) -> None:
    """Remove ``folder``, first renamed out of the complete ones (a kill during the removal leaves no half folder
    that looks complete)."""
    if _STEP.fullmatch(folder.name):
        doomed = folder.with_name(f"{folder.name}.old")
        shutil.rmtree(doomed, ignore_errors=True)
        folder = folder.rename(doomed)
    shutil.rmtree(folder, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Remove the staging and half-removed folders killed saves left in ``root``."""
    for path in root.iterdir():
        if _UNFINISHED.fullmatch(path.name):
            _remove(path)


def _sync_directory(path: Path) -> None:
    """Flush ``path``'s entries (the renames in it) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# ------------------------------------------------------------------------------------------- the files
def save_state(path: Path, state: dict[str, Any]) -> None:
    """``torch.save`` of ``state`` (tensors and plain values) to ``path``, flushed to disk."""
    with open(path, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())


def read_state(path: Path, map_location: torch.device | str | None = None) -> dict[str, Any]:
    """What :func:`save_state` wrote, loaded with ``weights_only=True``.

    Raises:
        InputError: ``path`` holds an object other than tensors and plain values (it is not run), or is unreadable.
    """
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise InputError(f"resume: {path} holds objects other than tensors and plain values, which a checkpoint "
                         f"of this run never does; it was refused, not loaded ({refusal_reason(err)}). Resume from "
                         "a checkpoint you wrote, or train without --resume") from None
    except (RuntimeError, OSError, EOFError) as err:
        raise InputError(f"resume: {path} cannot be read ({err}); resume from another checkpoint or train "
                         "without --resume") from None


def refusal_reason(err: pickle.UnpicklingError) -> str:
    """The line of a weights-only refusal that names what was refused (else its first line)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return next((line for line in lines if "GLOBAL" in line), lines[0] if lines else type(err).__name__)


# --------------------------------------------------------------------------------------- the run state
def run_state(scheduler: Any, sampler: PackedBatchSampler, step: int, stats: RunStats) -> dict[str, Any]:
    """What a checkpoint holds beside the model and optimizer: the schedule, this rank's sampler position, the
    step, the stats so far and the CPU random state (a uint8 tensor); plain values and tensors only."""
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


# ------------------------------------------------------------------------------------------ one process
def save_checkpoint(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    sampler: PackedBatchSampler, step: int, stats: RunStats,
                    rank_states: list[dict[str, Any]] | None = None) -> None:
    """Write the checkpoint of optimizer step ``step`` to ``root/step-N/state.pt`` and point ``latest`` at it.
    ``rank_states``: every rank's :func:`run_state` (rank order) of a replicated multi-rank run, each rank's own
    counts of what it trained."""
    staging = start_checkpoint(root, step)
    save_state(staging / STATE_FILE, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                      **run_state(scheduler, sampler, step, stats),
                                      **({RANK_STATES: rank_states} if rank_states is not None else {})})
    commit_checkpoint(root, step)


def load_checkpoint(root: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                    sampler: PackedBatchSampler, device: torch.device) -> tuple[int, RunStats]:
    """Restore, in place, the checkpoint ``latest`` names under ``root`` (every rank the one rank 0 chose);
    return the step to continue from and the stats so far."""
    state = agreed_checkpoint(root) / STATE_FILE
    if not state.is_file():  # the same on every rank: they all read the one folder
        raise InputError(f"resume: {state.parent} holds no {STATE_FILE} (a --fsdp run's checkpoint holds DCP's files "
                         "instead); resume with the settings of the run that wrote it")
    ckpt = read_state(state, map_location=device)
    ranks = ckpt.get(RANK_STATES, [ckpt])   # a single process's, or an earlier version's (rank 0's only)
    world = dist.get_world_size() if dist.is_initialized() else 1
    if RANK_STATES in ckpt and len(ranks) != world:
        raise InputError(f"resume: {state.parent} was written by {len(ranks)} ranks; resume on {len(ranks)} ranks")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    return restore_run_state(ranks[dist.get_rank() if RANK_STATES in ckpt else 0], scheduler, sampler)


class CheckpointSaver:
    """Called after every optimizer step: saves every ``every`` steps (0: never) and after ``last_step``, on rank 0."""

    def __init__(self, path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                 sampler: PackedBatchSampler, stats: RunStats, *, every: int, last_step: int, rank: int) -> None:
        self.path, self.model, self.optimizer, self.scheduler, self.sampler, self.stats = (
            path, model, optimizer, scheduler, sampler, stats)
        self.every, self.last_step, self.rank = every, last_step, rank

    def __call__(self, step: int) -> None:
        if not ((self.every and step % self.every == 0) or step == self.last_step):
            return
        ranks = (share_objects(run_state(self.scheduler, self.sampler, step, self.stats))
                 if dist.is_initialized() and dist.get_world_size() > 1 else None)   # every rank's own counts
        if self.rank == 0:
            save_checkpoint(self.path, self.model, self.optimizer, self.scheduler, self.sampler, step, self.stats,
                            rank_states=ranks)
