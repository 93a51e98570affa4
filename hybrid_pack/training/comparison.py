"""``--compare-padded``: train the packed run's examples again the usual way, padded, and compare.

The padded run starts from the same initial weights and takes the same examples, shuffled in dataset
order, in as many batches as the packed run had rows (so as many optimizer steps), each padded to its
longest (what ``DataCollatorWithPadding`` does). Reported: both throughputs (the first, warm-up step of
each run excluded), the padding ratio, the speed-up against its target, flagged when below it (and said
to be too short to judge under :data:`MIN_TIMED_STEPS`), and whether the losses agree (the same batch
packed and padded, and the ends of the runs).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.collate import PackingCollator
from hybrid_pack.schema import BOUNDARIES, INPUT_IDS, LABELS
from hybrid_pack.training.config import TrainConfig
from hybrid_pack.training.loop import REAL_TOKENS, MicroBatch, build_optimizer, train_pass
from hybrid_pack.training.padded import PaddingCollator
from hybrid_pack.training.stats import RunStats

MIN_TIMED_STEPS = 10
"""Timed steps (after the warm-up step) below which a speed-up is too noisy to judge against its target."""


def target_factor(device: torch.device) -> float:
    """The packed speed-up's target as a share of the padding ratio: 0.95 on CUDA (bf16), 0.9 elsewhere."""
    return 0.95 if device.type == "cuda" else 0.9


def padded_steps(features: Sequence[dict[str, Any]], order: Sequence[int], num_batches: int,
                 grad_accum: int) -> Iterator[list[MicroBatch]]:
    """Optimizer steps of padded batches: ``order`` cut into ``num_batches`` batches (sizes differ by at most one)."""
    collator = PaddingCollator()
    bounds = [round(i * len(order) / num_batches) for i in range(num_batches + 1)]
    batches = [order[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    for start in range(0, len(batches), grad_accum):
        micro = []
        for group in batches[start:start + grad_accum]:
            batch = collator([features[i] for i in group])
            micro.append({INPUT_IDS: batch[INPUT_IDS], LABELS: batch[LABELS],
                          REAL_TOKENS: sum(len(features[i][INPUT_IDS]) for i in group)})
        yield micro


@torch.no_grad()
def same_batch_loss_gap(model: torch.nn.Module, features: Sequence[dict[str, Any]], groups: Sequence[Sequence[int]],
                        device: torch.device) -> float:
    """Largest relative difference between the loss of a group packed and the same group padded."""
    gap = 0.0
    for group in groups:
        docs = [features[i] for i in group]
        packed = PackingCollator()(docs)
        padded = PaddingCollator()(docs)
        a = model(**{INPUT_IDS: packed[INPUT_IDS].to(device), LABELS: packed[LABELS].to(device),
                     BOUNDARIES: PackedBoundaries.from_batch(packed).to(device)}).loss
        b = model(**{INPUT_IDS: padded[INPUT_IDS].to(device), LABELS: padded[LABELS].to(device)}).loss
        gap = max(gap, abs(float(a) - float(b)) / max(abs(float(b)), 1e-12))
    return gap


def compare_padded(model: torch.nn.Module, initial_state: dict[str, torch.Tensor], features: Sequence[dict[str, Any]],
                   packed: RunStats, cfg: TrainConfig, device: torch.device, autocast: torch.dtype | None,
                   metrics: dict[str, Any]) -> RunStats:
    """Train the examples of the packed run padded, from the same initial weights; record the comparison in
    ``metrics`` and return the padded run's stats."""
    model.load_state_dict(initial_state)
    gap = same_batch_loss_gap(model, features, packed.groups[:3], device)
    used = sorted({i for group in packed.groups for i in group})
    order = [used[i] for i in torch.randperm(len(used), generator=torch.Generator().manual_seed(cfg.seed)).tolist()]
    num_batches = min(len(packed.groups), len(order))
    steps = math.ceil(num_batches / cfg.grad_accum)
    optimizer, scheduler = build_optimizer(model, cfg, steps)
    padded = train_pass(model, padded_steps(features, order, num_batches, cfg.grad_accum), total_steps=steps,
                        cfg=cfg, device=device, autocast=autocast, world=1, describe="padded", optimizer=optimizer,
                        scheduler=scheduler, stats=RunStats())
    tail = max(1, len(packed.losses) // 5)
    packed_tail = sum(packed.losses[-tail:]) / tail
    padded_tail = sum(padded.losses[-tail:]) / tail
    tail_gap = abs(packed_tail - padded_tail) / max(abs(padded_tail), 1e-12)
    ratio = padded.computed_tokens / max(1, padded.real_tokens)
    speedup = packed.tokens_per_second / max(padded.tokens_per_second, 1e-12)
    timed_steps = min(len(packed.losses), len(padded.losses)) - 1
    target = target_factor(device) * ratio
    metrics.update({
        "padded_tokens_per_second": padded.tokens_per_second, "padded_losses": padded.losses,
        "padded_steps": len(padded.losses), "padded_batch_size": len(order) / num_batches,
        "padded_tokens_ratio": ratio, "padded_peak_memory_bytes": padded.peak_memory_bytes,
        "timed_steps": timed_steps, "speedup": speedup, "target_factor": target_factor(device),
        "target_speedup": target, "speedup_meets_target": speedup >= target,
        "speedup_verdict": speedup_verdict(speedup, target, timed_steps),
        "same_batch_loss_rel_diff": gap, "final_loss_rel_diff": tail_gap,
        "losses_agree": gap < 1e-4 and tail_gap < 0.1,
    })
    return padded


def speedup_verdict(speedup: float, target: float, timed_steps: int) -> str:
    """``"meets target"`` or ``"BELOW TARGET"``, saying so when the run was too short to judge."""
    verdict = "meets target" if speedup >= target else "BELOW TARGET"
    if timed_steps < MIN_TIMED_STEPS:
        verdict += (f", run too short to judge: {max(timed_steps, 0)} timed step(s) after the warm-up step, "
                    f"need {MIN_TIMED_STEPS} (raise --max-examples, or train's --max-steps)")
    return verdict
