"""The optimizer-step loop shared by the packed run and the padded comparison.

Each step is a list of micro-batches (dicts with ``input_ids``, ``labels``, ``real_tokens`` and, for
packed rows, ``boundaries``). The loss of a step is the mean over its target tokens on every rank
(``num_items_in_batch``), whatever the grouping of the examples.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack import backends
from hybrid_pack.schema import (
    BOUNDARIES,
    HOST_BOUNDARIES,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    NUM_ITEMS_IN_BATCH,
    SHIFT_LABELS,
)
from hybrid_pack.testing.guard import PackingGuard
from hybrid_pack.training.config import TrainConfig
from hybrid_pack.training.schedule import warmup_cosine
from hybrid_pack.training.stats import RunStats

REAL_TOKENS = "real_tokens"
"""Micro-batch entry: tokens that are not padding (a Python int)."""

MicroBatch = dict[str, Any]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig,
                    total_steps: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with linear warm-up and cosine decay over ``total_steps``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = warmup_cosine(optimizer, warmup_steps=min(cfg.warmup_steps, max(1, total_steps // 10)),
                              total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio)
    return optimizer, scheduler


def count_targets(micro_batch: MicroBatch) -> int:
    """Next-token targets of a micro-batch: labels after the shift (its ``shift_labels`` when it is a
    context-parallel shard) that are not ``IGNORE_INDEX``."""
    shifted = micro_batch.get(SHIFT_LABELS)
    if shifted is not None:
        return int((shifted != IGNORE_INDEX).sum())
    return int((micro_batch[LABELS][..., 1:] != IGNORE_INDEX).sum())


def train_pass(model: torch.nn.Module, steps: Iterable[list[MicroBatch]], *, total_steps: int, cfg: TrainConfig,
               device: torch.device, autocast: torch.dtype | None, world: int, describe: str,
               optimizer: torch.optim.Optimizer, scheduler: Any, stats: RunStats, start_step: int = 0,
               on_step: Callable[[int], None] | None = None, guard: PackingGuard | None = None) -> RunStats:
    """Run optimizer steps ``start_step`` .. ``total_steps - 1`` over ``steps``, recording them in ``stats``.

    Each step's loss stays on the device, detached; the host reads them, and the device synchronises, only at a
    log point (docs/api.md §9b): the pass's first step (its time is the warm-up's), every ``cfg.log_every``-th and
    ``cfg.checkpoint_every``-th step, and the last. There the pending losses are read in one copy and appended to
    ``stats.losses``, one per step, and ``stats.seconds`` gains the time since the previous log point (data drawing
    included). ``on_step(step)`` runs at each log point (``step`` counts the steps done; every loss so far is in
    ``stats.losses``); ``guard.step`` names the step being run.
    """
    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else nullcontext()
    progress = _progress_bar(cfg, total_steps, start_step, describe)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = start_step
    batches = iter(steps)
    first = next(batches, None) if step < total_steps else None
    if first is not None:
        # The backends' one warm-up (collective under torch.distributed): one verdict per op and key for every
        # rank, settled before the first forward (a compiled graph finds its kernels checked: no check runs there).
        with amp:
            backends.verify(model=model, batch=_inputs(first[0], device, torch.tensor(count_targets(first[0]))))
    batches = itertools.chain([] if first is None else [first], batches)
    pending: list[torch.Tensor] = []   # the losses of the steps since the last log point, on the device
    _synchronize(device)
    began = time.perf_counter()
    while step < total_steps:  # checked before drawing: a drawn step is a trained step
        micro_batches = next(batches, None)
        if micro_batches is None:
            break
        if guard is not None:
            guard.step = step
        pending.append(_optimizer_step(model, micro_batches, optimizer, scheduler, cfg, device, amp, world, stats))
        step += 1
        if progress is not None:
            progress.update(1)
        if _is_log_point(step, start_step, total_steps, cfg):
            _log(pending, stats, began, device, first_step=step == 1, progress=progress, guard=guard)
            if on_step is not None:
                on_step(step)
            began = time.perf_counter()
    if pending:   # the data ran out before total_steps
        _log(pending, stats, began, device, first_step=step == 1, progress=progress, guard=guard)
        if on_step is not None:
            on_step(step)
    if progress is not None:
        progress.close()
    if device.type == "cuda":
        stats.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
    return stats


def _is_log_point(step: int, start_step: int, total_steps: int, cfg: TrainConfig) -> bool:
    """Whether the losses are read after ``step`` steps: the pass's first, every ``log_every``-th and
    ``checkpoint_every``-th (a checkpoint holds every loss so far), and the last."""
    return (step == start_step + 1 or step == total_steps or step % cfg.log_every == 0
            or (cfg.checkpoint_every > 0 and step % cfg.checkpoint_every == 0))


def _log(pending: list[torch.Tensor], stats: RunStats, began: float, device: torch.device, *, first_step: bool,
         progress: Any, guard: PackingGuard | None) -> None:
    """Read the ``pending`` steps' losses (one device-to-host copy) into ``stats.losses`` and the time since
    ``began`` into ``stats.seconds`` (the warm-up's, after the run's first step); ``pending`` is emptied."""
    stats.losses.extend(torch.stack(pending).tolist())   # the log point's one read (it waits for the device)
    pending.clear()
    _synchronize(device)
    elapsed = time.perf_counter() - began
    stats.seconds += elapsed
    if first_step:
        stats.warmup_seconds, stats.warmup_tokens = elapsed, stats.real_tokens
    if progress is not None:
        guarded = {} if guard is None else {"guard": f"{len(guard.records)} checks ok"}
        progress.set_postfix(loss=f"{stats.losses[-1]:.3f}", tok_s=f"{stats.tokens_per_second:,.0f}", **guarded)


def _optimizer_step(model: torch.nn.Module, micro_batches: list[MicroBatch], optimizer: torch.optim.Optimizer,
                    scheduler: Any, cfg: TrainConfig, device: torch.device, amp: AbstractContextManager[Any],
                    world: int, stats: RunStats) -> torch.Tensor:
    """Forward and backward every micro-batch, clip, step; return the step's loss (every rank's: one all-reduce), a
    detached float32 0-d tensor on ``device``. Nothing is read from the device."""
    items = torch.tensor(sum(count_targets(mb) for mb in micro_batches), device=device)
    if world > 1:
        dist.all_reduce(items)
    step_loss = torch.zeros((), device=device)
    for mb in micro_batches:
        with amp:
            out = model(**_inputs(mb, device, items))
        # This rank's share of the step's loss; DDP and FSDP2 (over the world: the ("dp", "cp") mesh flattened)
        # average the gradients over the ranks, so `* world` makes them the sum of the shares' gradients.
        loss = out.loss * world
        loss.backward()
        step_loss += loss.detach().float() / world
        stats.real_tokens += int(mb[REAL_TOKENS])
        stats.computed_tokens += int(mb[INPUT_IDS].numel())
    if world > 1:
        dist.all_reduce(step_loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss


def _inputs(micro_batch: MicroBatch, device: torch.device, items: torch.Tensor) -> dict[str, Any]:
    """The model's keyword arguments for one micro-batch, on ``device`` (``items``: the step's target count)."""
    boundaries = micro_batch.get(BOUNDARIES)
    inputs = {key: value.to(device, non_blocking=True) for key, value in micro_batch.items()
              if isinstance(value, torch.Tensor)}
    if micro_batch.get(HOST_BOUNDARIES) is not None:  # a static row's lengths, kept on the host (§9b)
        inputs[HOST_BOUNDARIES] = micro_batch[HOST_BOUNDARIES]
    inputs[BOUNDARIES] = boundaries.to(device) if boundaries is not None else None
    inputs[NUM_ITEMS_IN_BATCH] = items.to(device)
    return inputs


def _progress_bar(cfg: TrainConfig, total_steps: int, start_step: int, describe: str) -> Any:
    if not cfg.progress or (dist.is_initialized() and dist.get_rank() != 0):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total_steps, initial=start_step, desc=describe, unit="step", leave=True)


def _synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA): at the start of a pass and at its log points only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
