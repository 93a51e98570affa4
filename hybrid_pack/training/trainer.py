"""Packed supervised fine-tuning: the loop behind ``hybrid-pack train`` and ``hybrid-pack demo``.

Each optimizer step takes ``grad_accum`` packed rows from :class:`~hybrid_pack.PackedBatchSampler`
(one per rank and micro-step), collated by :class:`~hybrid_pack.PackingCollator`. The loss is the
mean over the step's target tokens (``num_items_in_batch``). ``--compare-padded`` then trains the
same examples from the same initial weights the usual way (shuffled, padded to the longest of each
batch) and checks that a batch gives the same loss packed and padded.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.collate import PackingCollator
from hybrid_pack.packing.sampler import PackedBatchSampler
from hybrid_pack.training.config import TrainConfig
from hybrid_pack.training.data import build_features, load_chats
from hybrid_pack.training.padded import PaddingCollator
from hybrid_pack.training.plots import plot_loss, plot_pack_fill
from hybrid_pack.training.schedule import warmup_cosine

CHECKPOINT = "checkpoint.pt"


@dataclass
class RunStats:
    """What one training pass measured."""

    losses: list[float] = field(default_factory=list)
    real_tokens: int = 0
    computed_tokens: int = 0
    seconds: float = 0.0
    warmup_seconds: float = 0.0
    warmup_tokens: int = 0
    groups: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """Real (non-padding) tokens per second, the first step (warm-up) excluded when there are more."""
        tokens, seconds = self.real_tokens - self.warmup_tokens, self.seconds - self.warmup_seconds
        if tokens <= 0 or seconds <= 0:
            tokens, seconds = self.real_tokens, self.seconds
        return tokens / seconds if seconds > 0 else 0.0


def _setup_distributed() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def _device_and_autocast(cfg: TrainConfig) -> tuple[torch.device, torch.dtype | None]:
    if cfg.device:
        device = torch.device(cfg.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and bf16_ok):
        return device, torch.bfloat16
    return device, None


def build_model(cfg: TrainConfig) -> torch.nn.Module:
    """A preset (fresh weights, seeded) or a patched Hugging Face model from a local directory."""
    torch.manual_seed(cfg.seed)
    if (Path(cfg.model) / "config.json").is_file():
        from transformers import AutoConfig, AutoModelForCausalLM

        from hybrid_pack.integrations.transformers import patch_model

        has_weights = any(Path(cfg.model).glob("*.safetensors")) or any(Path(cfg.model).glob("*.bin"))
        model = (AutoModelForCausalLM.from_pretrained(cfg.model) if has_weights
                 else AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model)))
        return patch_model(model.float())
    from hybrid_pack.modeling import from_preset

    return from_preset(cfg.model)


def _optimizer(model: torch.nn.Module, cfg: TrainConfig, total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with linear warm-up and cosine decay over ``total_steps``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = warmup_cosine(optimizer, warmup_steps=min(cfg.warmup_steps, max(1, total_steps // 10)),
                              total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio)
    return optimizer, scheduler


def _targets(labels: torch.Tensor) -> int:
    """Next-token targets of a batch: labels after the shift that are not -100."""
    return int((labels[..., 1:] != -100).sum())


def _train_pass(model: torch.nn.Module, steps: Iterable[list[dict[str, Any]]], *, total_steps: int,
                cfg: TrainConfig, device: torch.device, autocast: torch.dtype | None, world: int,
                describe: str, on_step: Callable[[int], None] | None = None,
                start_step: int = 0, optimizer: torch.optim.Optimizer | None = None,
                scheduler: Any = None, stats: RunStats | None = None) -> tuple[RunStats, Any, Any]:
    """Run optimizer steps over ``steps`` (each a list of micro-batches already collated)."""
    stats = stats or RunStats()
    if optimizer is None:
        optimizer, scheduler = _optimizer(model, cfg, total_steps)
    amp = torch.autocast(device.type, dtype=autocast) if autocast is not None else nullcontext()
    progress = None
    if cfg.progress and (not dist.is_initialized() or dist.get_rank() == 0):
        from tqdm.auto import tqdm

        progress = tqdm(total=total_steps, initial=start_step, desc=describe, unit="step", leave=True)
    model.train()
    step = start_step
    for micro_batches in steps:
        if step >= total_steps:
            break
        sync = device.type == "cuda"
        if sync:
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        items = torch.tensor(sum(_targets(mb["labels"]) for mb in micro_batches), device=device)
        if world > 1:
            dist.all_reduce(items)
        step_loss = 0.0
        for mb in micro_batches:
            boundaries = mb.pop("boundaries", None)
            inputs = {k: mb[k].to(device, non_blocking=True) for k in ("input_ids", "labels")}
            with amp:
                out = model(**inputs, boundaries=boundaries.to(device) if boundaries is not None else None,
                            num_items_in_batch=items)
            loss = out.loss * world
            loss.backward()
            step_loss += float(loss.detach()) / world
            stats.real_tokens += int(mb["real_tokens"])
            stats.computed_tokens += int(mb["input_ids"].numel())
        if world > 1:
            step_tensor = torch.tensor(step_loss, device=device)
            dist.all_reduce(step_tensor)
            step_loss = float(step_tensor)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if sync:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - began
        stats.seconds += elapsed
        if step == 0:
            stats.warmup_seconds = elapsed
            stats.warmup_tokens = stats.real_tokens
        stats.losses.append(step_loss)
        step += 1
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{step_loss:.3f}", tok_s=f"{stats.tokens_per_second:,.0f}")
        if on_step is not None:
            on_step(step)
    if progress is not None:
        progress.close()
    return stats, optimizer, scheduler


class _PackedSteps:
    """Optimizer steps of packed micro-batches drawn from the sampler (what a ``DataLoader`` with
    ``batch_sampler=sampler`` and no workers yields), recording each micro-batch's example indices."""

    def __init__(self, features: Sequence[dict[str, Any]], sampler: PackedBatchSampler, grad_accum: int,
                 epochs: int, groups: list[list[int]]) -> None:
        self.features, self.sampler, self.grad_accum, self.epochs, self.groups = (
            features, sampler, grad_accum, epochs, groups)

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        collator = PackingCollator()
        for epoch in range(self.sampler.epoch, self.epochs):
            self.sampler.set_epoch(epoch)
            micro: list[dict[str, Any]] = []
            for indices in self.sampler:
                self.groups.append(list(indices))
                batch = collator([self.features[i] for i in indices])
                micro.append({"input_ids": batch["input_ids"], "labels": batch["labels"],
                              "boundaries": PackedBoundaries.from_batch(batch),
                              "real_tokens": batch["input_ids"].shape[1] - batch.get("num_pad_tokens", 0)})
                if len(micro) == self.grad_accum:
                    yield micro
                    micro = []
            if micro:
                yield micro


def _padded_steps(features: Sequence[dict[str, Any]], order: Sequence[int], batch_size: int,
                  grad_accum: int) -> Iterator[list[dict[str, Any]]]:
    """Optimizer steps of padded batches: ``order`` cut into batches of ``batch_size`` examples."""
    collator = PaddingCollator()
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    for start in range(0, len(batches), grad_accum):
        micro = []
        for group in batches[start:start + grad_accum]:
            batch = collator([features[i] for i in group])
            micro.append({"input_ids": batch["input_ids"], "labels": batch["labels"],
                          "real_tokens": sum(len(features[i]["input_ids"]) for i in group)})
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
        a = model(input_ids=packed["input_ids"].to(device), labels=packed["labels"].to(device),
                  boundaries=PackedBoundaries.from_batch(packed).to(device)).loss
        b = model(input_ids=padded["input_ids"].to(device), labels=padded["labels"].to(device)).loss
        gap = max(gap, abs(float(a) - float(b)) / max(abs(float(b)), 1e-12))
    return gap


def _save_checkpoint(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                     sampler: PackedBatchSampler, step: int, stats: RunStats) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "sampler": sampler.state_dict(), "step": step, "losses": stats.losses, "groups": stats.groups,
                "real_tokens": stats.real_tokens, "computed_tokens": stats.computed_tokens,
                "seconds": stats.seconds, "warmup_seconds": stats.warmup_seconds,
                "warmup_tokens": stats.warmup_tokens}, tmp)
    os.replace(tmp, path)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train, write ``metrics.json`` and plots to ``cfg.out``, and return the metrics."""
    began = time.perf_counter()
    rank, world = _setup_distributed()
    if cfg.compare_padded and world > 1:
        raise ValueError("compare_padded: run the padded comparison on one process (without torchrun)")
    device, autocast = _device_and_autocast(cfg)
    out = cfg.out_dir
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    model = build_model(cfg).to(device)
    vocab_size = model.config.vocab_size
    chats = load_chats(cfg.data, cfg.max_examples)
    features, remap = build_features(chats, vocab_size, max_length=cfg.capacity)
    if remap is not None and rank == 0:
        remap.save(out / "vocab_remap.json")
    metrics: dict[str, Any] = {"model": cfg.model, "data": cfg.data, "examples": len(features), "device": device.type,
                               "dtype": str(autocast or torch.float32).removeprefix("torch."), "world_size": world,
                               "capacity": cfg.capacity, "isolation_ok": None}

    if cfg.isolation_check:
        from hybrid_pack.testing import check_isolation

        report = check_isolation(model, max_tokens=min(cfg.capacity, 512), seed=cfg.seed)
        metrics["isolation_ok"] = report.ok
        metrics["isolation_max_leak"] = report.max_leak
        if rank == 0:
            (out / "isolation.json").write_text(report.to_json(indent=1))
        if not report.ok:
            raise IsolationFailed(report)

    lengths = [len(f["input_ids"]) for f in features]
    sampler = PackedBatchSampler(lengths, cfg.capacity, num_replicas=world, rank=rank, seed=cfg.seed)
    steps_per_epoch = math.ceil(len(sampler) / cfg.grad_accum)
    total_steps = min(cfg.max_steps or 10**12, steps_per_epoch * cfg.epochs)
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()} if cfg.compare_padded else None

    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    stats, optimizer, scheduler, start_step = RunStats(), None, None, 0
    ckpt_path = out / CHECKPOINT
    if cfg.resume:
        if not ckpt_path.is_file():
            raise ValueError(f"resume: no checkpoint at {ckpt_path}; train without --resume first")
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        _unwrap(model).load_state_dict(ckpt["model"])
        optimizer, scheduler = _optimizer(model, cfg, total_steps)
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        sampler.load_state_dict(ckpt["sampler"])
        start_step = ckpt["step"]
        stats = RunStats(losses=list(ckpt["losses"]), groups=list(ckpt["groups"]), real_tokens=ckpt["real_tokens"],
                         computed_tokens=ckpt["computed_tokens"], seconds=ckpt["seconds"],
                         warmup_seconds=ckpt["warmup_seconds"], warmup_tokens=ckpt["warmup_tokens"])

    holder: dict[str, Any] = {}

    def on_step(step: int) -> None:
        due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0
        if rank == 0 and (due or step == total_steps):
            _save_checkpoint(ckpt_path, _unwrap(model), holder["optimizer"], holder["scheduler"], sampler, step,
                             stats)

    steps = _PackedSteps(features, sampler, cfg.grad_accum, cfg.epochs, stats.groups)
    if optimizer is None:
        optimizer, scheduler = _optimizer(model, cfg, total_steps)
    holder.update(optimizer=optimizer, scheduler=scheduler)
    stats, _, _ = _train_pass(model, steps, total_steps=total_steps, cfg=cfg, device=device, autocast=autocast,
                              world=world, describe="packed", on_step=on_step, start_step=start_step,
                              optimizer=optimizer, scheduler=scheduler, stats=stats)
    tokens_per_second = stats.tokens_per_second
    if world > 1:  # every rank's tokens over the slowest rank's time
        tokens, seconds = (torch.tensor([float(v)]) for v in (stats.real_tokens - stats.warmup_tokens,
                                                               stats.seconds - stats.warmup_seconds))
        dist.all_reduce(tokens)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        tokens_per_second = float(tokens / seconds) if float(seconds) > 0 else 0.0
    fills = [sum(lengths[i] for i in g) / cfg.capacity for g in stats.groups]
    metrics["parameters_checksum"] = float(sum(p.detach().double().sum() for p in _unwrap(model).parameters()))
    metrics.update({
        "steps": len(stats.losses), "packs": len(stats.groups), "real_tokens": stats.real_tokens,
        "tokens_per_second": tokens_per_second, "packing_efficiency": sampler.plan.efficiency,
        "packs_lower_bound": sampler.plan.lower_bound, "packs_per_epoch": sampler.num_packs,
        "mean_pack_fill": sum(fills) / max(1, len(fills)), "final_loss": stats.losses[-1] if stats.losses else None,
        "first_loss": stats.losses[0] if stats.losses else None, "losses": stats.losses, "seconds": stats.seconds,
    })

    padded_stats = None
    if cfg.compare_padded:
        padded_stats = _compare_padded(model, initial_state, features, stats, cfg, device, autocast, metrics)
    metrics["wall_seconds"] = time.perf_counter() - began
    if rank == 0:
        plot_loss(out / "loss.png", stats.losses, padded_stats.losses if padded_stats else None)
        plot_pack_fill(out / "pack_fill.png", fills, cfg.capacity)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics


def _compare_padded(model: torch.nn.Module, initial_state: dict[str, torch.Tensor], features: Sequence[dict[str, Any]],
                    packed: RunStats, cfg: TrainConfig, device: torch.device, autocast: torch.dtype | None,
                    metrics: dict[str, Any]) -> RunStats:
    """Train the examples of the packed run again, shuffled in dataset order and padded to their longest
    (``DataCollatorWithPadding``), from the same initial weights; record the comparison in ``metrics``."""
    model.load_state_dict(initial_state)
    gap = same_batch_loss_gap(model, features, packed.groups[:3], device)
    used = sorted({i for group in packed.groups for i in group})
    order = [used[i] for i in torch.randperm(len(used), generator=torch.Generator().manual_seed(cfg.seed)).tolist()]
    batch_size = max(1, round(len(used) / max(1, len(packed.groups))))
    steps = math.ceil(math.ceil(len(order) / batch_size) / cfg.grad_accum)
    padded, _, _ = _train_pass(model, _padded_steps(features, order, batch_size, cfg.grad_accum), total_steps=steps,
                               cfg=cfg, device=device, autocast=autocast, world=1, describe="padded")
    tail = max(1, len(packed.losses) // 5)
    packed_tail = sum(packed.losses[-tail:]) / tail
    padded_tail = sum(padded.losses[-tail:]) / tail
    tail_gap = abs(packed_tail - padded_tail) / max(abs(padded_tail), 1e-12)
    ratio = padded.computed_tokens / max(1, padded.real_tokens)
    metrics.update({
        "padded_tokens_per_second": padded.tokens_per_second, "padded_losses": padded.losses,
        "padded_batch_size": batch_size, "padded_tokens_ratio": ratio,
        "speedup": packed.tokens_per_second / max(padded.tokens_per_second, 1e-12),
        "target_speedup": 0.9 * ratio,
        "same_batch_loss_rel_diff": gap, "final_loss_rel_diff": tail_gap,
        "losses_agree": gap < 1e-4 and tail_gap < 0.1,
    })
    return padded


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


class IsolationFailed(RuntimeError):
    """The harness found a leak before training; carries the report."""

    def __init__(self, report: Any) -> None:
        super().__init__(f"isolation check failed; not training a model that mixes documents:\n{report}")
        self.report = report
