"""Packed supervised fine-tuning: the run behind ``hybrid-pack train`` and ``hybrid-pack demo``.

A run, step by step (:func:`train`): start the processes and pick the device; build the model and
tokenize the data; optionally prove the model isolated first (the harness); plan the packs; attach the
runtime guard; start or resume the optimizer; train; measure; save the model (``OUT/model``, the usual
``save_pretrained`` directory in the tokenizer's ids); optionally train the same examples padded and
compare; write ``metrics.json`` and the plots.

Each optimizer step takes ``grad_accum`` packed rows from :class:`~hybrid_pack.PackedBatchSampler`
(one per rank and micro-step), collated by :class:`~hybrid_pack.PackingCollator`; the model gets each
row's :class:`~hybrid_pack.PackedBoundaries`, built on the host, as ``boundaries=``.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh

from hybrid_pack.backends import decisions
from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.collate import PackingCollator
from hybrid_pack.distributed import agree_max, end_process_group, gather_rows
from hybrid_pack.errors import InputError, IsolationError, MissingExtraError
from hybrid_pack.ops.selfcheck.result import device_name
from hybrid_pack.packing.sampler import PackedBatchSampler
from hybrid_pack.parallel.mesh import CP, DP, context_parallel_mesh
from hybrid_pack.parallel.parallelize import parallelize
from hybrid_pack.parallel.shard import shard_batch
from hybrid_pack.schema import (
    BOUNDARIES,
    CU_SEQ_LENS_Q,
    HOST_BOUNDARIES,
    INPUT_IDS,
    LABELS,
    NUM_PAD_TOKENS,
    POSITION_IDS,
    SEQ_IDX,
    SHIFT_LABELS,
)
from hybrid_pack.testing.guard import PackingGuard
from hybrid_pack.training.checkpoint import CHECKPOINT, CheckpointSaver, load_checkpoint
from hybrid_pack.training.comparison import compare_padded
from hybrid_pack.training.config import TrainConfig
from hybrid_pack.training.data import TOKENIZER_VOCAB, TrainingData, load_chats, prepare_data
from hybrid_pack.training.export import MODEL_DIR, save_trained_model
from hybrid_pack.training.loop import REAL_TOKENS, MicroBatch, build_optimizer, train_pass
from hybrid_pack.training.plots import plot_loss, plot_pack_fill
from hybrid_pack.training.reporting import Reporter, report_targets
from hybrid_pack.training.sharded import (
    ShardedCheckpointSaver,
    load_sharded_checkpoint,
    parameters_checksum,
    shard_model,
    unsharded_model,
)
from hybrid_pack.training.stats import RunStats

__all__ = ["IsolationFailed", "build_model", "train"]

IsolationFailed = IsolationError
"""The name the training module used for a leak found before or while training; the same class as
:class:`hybrid_pack.errors.IsolationError`, kept so ``except IsolationFailed`` keeps working."""


@dataclass(frozen=True)
class _Process:
    """Where this process runs: its rank among ``world`` processes, its device, the autocast dtype, the run
    directory, and whether the run started the process group (then it also ends it)."""

    rank: int
    world: int
    device: torch.device
    autocast: torch.dtype | None
    out: Path
    owns_process_group: bool = False
    mesh: DeviceMesh | None = None

    @property
    def replica(self) -> tuple[int, int]:
        """``(rank, size)`` among the data-parallel replicas (a context-parallel group is one replica)."""
        if self.mesh is None:
            return self.rank, self.world
        return self.mesh.get_local_rank(DP), self.mesh.size(0)

    @property
    def cp_group(self) -> Any:
        """The context-parallel process group (None without context parallelism)."""
        return None if self.mesh is None else self.mesh.get_group(CP)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train, write ``metrics.json`` and plots to ``cfg.out``, and return the metrics.

    Raises:
        IsolationError: the harness (``isolation_check``) or the runtime guard (``guard_every``) found a leak;
            ``metrics.json`` then holds the guard's checks so far.
    """
    began = time.perf_counter()
    proc = _start(cfg)
    try:
        metrics = _train(cfg, proc, began)
    except BaseException:
        if proc.owns_process_group:  # no barrier: the other ranks may never reach it
            dist.destroy_process_group()
        raise
    if proc.owns_process_group:
        end_process_group()
    return metrics


def _train(cfg: TrainConfig, proc: _Process, began: float) -> dict[str, Any]:
    model = build_model(cfg).to(proc.device)
    data = _load_data(cfg, model, proc)
    features = data.features
    metrics = _run_metrics(cfg, proc, data)
    if cfg.isolation_check:
        _check_isolation_first(model, cfg, proc, metrics)
    # Compiled with FSDP2, context parallelism or activation checkpointing, the blocks are compiled one by one
    # (FSDP2's hooks and a shard's exchanges stay between the graphs); otherwise the whole model is one graph.
    compile_blocks = cfg.compile and (cfg.fsdp or cfg.context_parallel > 1 or cfg.activation_checkpointing)
    if cfg.fsdp:  # FSDP2's mixed-precision policy casts, not autocast
        metrics["fsdp"] = shard_model(model, proc.device, proc.world, mesh=proc.mesh,
                                      activation_checkpointing=cfg.activation_checkpointing, compile=compile_blocks)
        metrics["dtype"] = metrics["fsdp"]["dtype"]
        proc = replace(proc, autocast=None)
    elif cfg.activation_checkpointing or compile_blocks:
        parallelize(model, mesh=proc.mesh, activation_checkpointing=cfg.activation_checkpointing,
                    compile=compile_blocks)
    metrics["activation_checkpointing"] = cfg.activation_checkpointing
    lengths = [len(f[INPUT_IDS]) for f in features]
    replica, replicas = proc.replica
    sampler = PackedBatchSampler(lengths, cfg.capacity, num_replicas=replicas, rank=replica, seed=cfg.seed)
    if cfg.compile:  # the static shape (docs/api.md §9): every row `capacity` tokens, the fullest pack's documents
        metrics.update(pack_length=cfg.capacity, max_documents=int(sampler.plan.pack_num_documents.max()))
    initial_state = {k: v.detach().clone() for k, v in model.state_dict().items()} if cfg.compare_padded else None
    # Compiled whole, the packed run goes through the compiled module; the guard hooks that module, so its checks run
    # outside the graph, and the padded comparison (other shapes) runs the model itself, eagerly.
    packed_model = torch.compile(model) if cfg.compile and not compile_blocks else model
    if cfg.compile:
        metrics["compiled"] = "every decoder block" if compile_blocks else "the whole model"
    guarded = cfg.guard_every and proc.mesh is None  # the guard checks whole rows, not context-parallel shards
    if cfg.guard_every and not guarded:
        metrics["guard_off"] = ("context-parallel shards: the guard checks whole rows; prove isolation with "
                                "check_isolation (hybrid-pack check) on the unsharded model")
    guard = PackingGuard(packed_model, every=cfg.guard_every, seed=cfg.seed,
                         group=dist.group.WORLD if proc.world > 1 else None).attach() if guarded else None
    try:
        stats = _train_packed(model, packed_model, features, sampler, cfg, proc, guard, metrics.get("max_documents"))
    except IsolationError:
        _write_metrics(proc, metrics, guard)
        raise
    finally:
        if guard is not None:
            guard.detach()
    metrics.update(_packed_metrics(model, stats, sampler, lengths, cfg, proc))
    exported = unsharded_model(model, lambda: build_model(cfg), proc.rank) if cfg.fsdp else model
    if proc.rank == 0:
        metrics.update(save_trained_model(exported, data.remap, proc.out / MODEL_DIR, TOKENIZER_VOCAB,
                                          data.tokenizer))
    if cfg.compile:
        metrics["compiles"], metrics["recompiles"] = stats.compiles, stats.recompiles
    padded_stats = None
    if cfg.compare_padded:
        padded_stats = compare_padded(model, initial_state, features, stats, cfg, proc.device, proc.autocast, metrics)
    metrics["wall_seconds"] = time.perf_counter() - began
    if proc.rank == 0:
        plot_loss(proc.out / "loss.png", stats.losses, padded_stats.losses if padded_stats else None)
        plot_pack_fill(proc.out / "pack_fill.png", _pack_fills(stats, lengths, cfg.capacity), cfg.capacity)
    _write_metrics(proc, metrics, guard)
    return metrics


def build_model(cfg: TrainConfig) -> torch.nn.Module:
    """A preset (fresh weights, seeded), a native model a run saved (``HybridForCausalLM.save_pretrained``), or a
    patched Hugging Face model from a local directory."""
    from hybrid_pack.modeling import HybridForCausalLM

    torch.manual_seed(cfg.seed)
    if HybridForCausalLM.saved_in(cfg.model):
        return HybridForCausalLM.from_pretrained(cfg.model).float()
    if (Path(cfg.model) / "config.json").is_file():
        from hybrid_pack.integrations.transformers import patch_model

        has_weights = any(Path(cfg.model).glob("*.safetensors")) or any(Path(cfg.model).glob("*.bin"))
        return patch_model(hf_causal_lm(cfg.model, weights=has_weights).float())
    from hybrid_pack.modeling import from_preset

    return from_preset(cfg.model)


def hf_causal_lm(folder: str, *, weights: bool) -> torch.nn.Module:
    """The causal LM of a Hugging Face model folder, with its weights or fresh from its config; InputError naming
    the folder when transformers cannot build one from it (an unknown ``model_type``, no causal-LM class);
    MissingExtraError without the ``hf`` extra."""
    try:
        import transformers
    except ImportError as err:
        raise MissingExtraError(f"the Hugging Face model folder {folder!r}", "hf", err) from err

    try:
        if weights:
            return transformers.AutoModelForCausalLM.from_pretrained(folder)
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
    except (ValueError, KeyError, OSError) as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise InputError(f"model: transformers {transformers.__version__} cannot build a causal LM from {folder!r}: "
                         f"{reason}") from None


# ------------------------------------------------------------------------------------------ steps of a run
def _start(cfg: TrainConfig) -> _Process:
    """Join the process group under ``torchrun``, pick the device and autocast dtype, make the run directory."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.compare_padded and world > 1:
        raise InputError("compare_padded: run the padded comparison on one process (without torchrun)")
    owns_process_group = world > 1 and not dist.is_initialized()
    if owns_process_group:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    if cfg.device:
        device = torch.device(cfg.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        device = torch.device("cpu")
    bf16_ok = device.type == "cuda" and torch.cuda.is_bf16_supported()
    autocast = torch.bfloat16 if cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and bf16_ok) else None
    out = cfg.out_dir
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    mesh = context_parallel_mesh(cfg.context_parallel, device.type)
    return _Process(rank=rank, world=world, device=device, autocast=autocast, out=out,
                    owns_process_group=owns_process_group, mesh=mesh)


def _load_data(cfg: TrainConfig, model: torch.nn.Module, proc: _Process) -> TrainingData:
    """Tokenized examples fit to ``capacity`` (``cfg.overflow``), in the model's vocabulary (a vocabulary remap
    is saved when one is needed), with the count of what was cut or left out."""
    data = prepare_data(load_chats(cfg.data, cfg.max_examples), model.config.vocab_size, capacity=cfg.capacity,
                        overflow=cfg.overflow, tokenizer=cfg.chat_tokenizer)
    if data.remap is not None and proc.rank == 0:
        data.remap.save(proc.out / "vocab_remap.json")
    return data


def _run_metrics(cfg: TrainConfig, proc: _Process, data: TrainingData) -> dict[str, Any]:
    return {"model": cfg.model, "data": cfg.data, **data.report.to_metrics(), "overflow": cfg.overflow,
            "device": proc.device.type, "dtype": str(proc.autocast or torch.float32).removeprefix("torch."),
            "world_size": proc.world, "context_parallel": cfg.context_parallel, "capacity": cfg.capacity,
            "isolation_ok": None}


def _check_isolation_first(model: torch.nn.Module, cfg: TrainConfig, proc: _Process, metrics: dict[str, Any]) -> None:
    """The harness on the model before any training; a leak stops the run (report in ``isolation.json``)."""
    from hybrid_pack.testing import check_isolation

    report = check_isolation(model, max_tokens=min(cfg.capacity, 512), seed=cfg.seed,
                             progress=cfg.progress and proc.rank == 0)
    metrics["isolation_ok"] = report.ok
    metrics["isolation_max_leak"] = report.max_leak
    if proc.rank == 0:
        (proc.out / "isolation.json").write_text(report.to_json(indent=1))
    if not report.ok:
        raise IsolationError(f"isolation check failed; not training a model that mixes documents:\n{report}", report)


def _train_packed(model: torch.nn.Module, packed_model: torch.nn.Module, features: Sequence[dict[str, Any]],
                  sampler: PackedBatchSampler, cfg: TrainConfig, proc: _Process, guard: PackingGuard | None,
                  max_documents: int | None) -> RunStats:
    """The packed run of ``packed_model`` (``model``, or with ``cfg.compile`` its compiled module): DDP over ranks,
    a fresh or resumed optimizer, checkpoints of ``model``, the guard naming each step.

    With ``max_documents`` (``cfg.compile``) the rows are static batches; ``stats.compiles`` counts the graphs
    compiled during the run.
    """
    total_steps = min(cfg.max_steps or 10**12, math.ceil(len(sampler) / cfg.grad_accum) * cfg.epochs)
    trained = (torch.nn.parallel.DistributedDataParallel(packed_model) if proc.world > 1 and not cfg.fsdp
               else packed_model)
    optimizer, scheduler = build_optimizer(trained, cfg, total_steps)
    start_step, stats = 0, RunStats()
    if cfg.resume and cfg.fsdp:
        start_step, stats = load_sharded_checkpoint(proc.out / CHECKPOINT, model, optimizer, scheduler,
                                                    sampler)
    elif cfg.resume:
        start_step, stats = load_checkpoint(proc.out / CHECKPOINT, model, optimizer, scheduler, sampler, proc.device)
    saver = (ShardedCheckpointSaver if cfg.fsdp else CheckpointSaver)(
        proc.out / CHECKPOINT, model, optimizer, scheduler, sampler, stats,
        every=cfg.checkpoint_every, last_step=total_steps, rank=proc.rank)
    reporter = _start_reporter(cfg, proc)

    graphs_before = counters["stats"]["unique_graphs"]
    graphs_after_first_step = graphs_before

    logged = start_step

    def after_step(step: int) -> None:   # at train_pass's log points: every loss so far is read
        nonlocal graphs_after_first_step, logged
        if step == start_step + 1:
            graphs_after_first_step = counters["stats"]["unique_graphs"]
        saver(step)
        for done in range(logged + 1, step):
            reporter.log(done, {"train/loss": stats.losses[done - 1]})
        logged = step
        reporter.log(step, {"train/loss": stats.losses[-1], "train/learning_rate": scheduler.get_last_lr()[0],
                            "train/tokens_per_second": stats.tokens_per_second})

    collator = (PackingCollator(pack_length=cfg.capacity, max_documents=max_documents) if max_documents
                else PackingCollator(pad_to_multiple_of=cfg.row_multiple))
    steps = _PackedSteps(features, sampler, cfg.grad_accum, cfg.epochs, stats.groups, collator, proc.cp_group,
                         cfg.context_parallel, cfg.cp_layout)
    try:
        return train_pass(trained, steps, total_steps=total_steps, cfg=cfg, device=proc.device,
                          autocast=proc.autocast, world=proc.world, describe="packed", optimizer=optimizer,
                          scheduler=scheduler, stats=stats, start_step=start_step, on_step=after_step, guard=guard)
    finally:
        reporter.close()
        if max_documents:
            stats.compiles = counters["stats"]["unique_graphs"] - graphs_before
            stats.recompiles = counters["stats"]["unique_graphs"] - graphs_after_first_step


def _start_reporter(cfg: TrainConfig, proc: _Process) -> Reporter:
    """``--report-to`` on rank 0. Every rank learns whether it started: one rank raising alone would leave the
    others waiting at the first collective."""
    try:
        reporter, error = Reporter(report_targets(cfg.report_to) if proc.rank == 0 else (), proc.out,
                                   cfg.to_dict()), None
    except Exception as err:  # wandb or TensorBoard failing to start (login, network, a full disk)
        reporter, error = None, err
    if proc.world > 1 and agree_max([float(error is not None)])[0] and error is None:
        raise InputError("report_to: the reporting integration failed to start on rank 0 (its error is there)")
    if error is not None:
        raise error
    return reporter


def _packed_metrics(model: torch.nn.Module, stats: RunStats, sampler: PackedBatchSampler, lengths: Sequence[int],
                    cfg: TrainConfig, proc: _Process) -> dict[str, Any]:
    """What the steps trained, summed over the data-parallel replicas (every row once, whatever its split into
    context-parallel shards): packs, documents and real tokens; throughput (those tokens over the slowest rank's
    time); packing, losses and a parameter checksum."""
    trained = [float(len(stats.groups)), float(sum(len(group) for group in stats.groups)), float(stats.real_tokens),
               float(stats.real_tokens - stats.warmup_tokens)]
    seconds = stats.seconds - stats.warmup_seconds
    if proc.world > 1:  # every rank of a context-parallel group trained the same rows: count them once
        trained = [sum(column) / cfg.context_parallel for column in zip(*gather_rows(trained))]
        seconds = agree_max([seconds])[0]
    packs, documents, real_tokens, timed_tokens = (round(v) for v in trained)
    if timed_tokens <= 0 or seconds <= 0:
        timed_tokens, seconds = real_tokens, (agree_max([stats.seconds])[0] if proc.world > 1 else stats.seconds)
    fills = _pack_fills(stats, lengths, cfg.capacity)
    return {
        "parameters_checksum": parameters_checksum(model),
        "steps": len(stats.losses), "packs": packs, "documents_trained": documents, "real_tokens": real_tokens,
        "tokens_per_second": timed_tokens / seconds if seconds > 0 else 0.0,
        "packing_efficiency": sampler.plan.efficiency,
        "packs_lower_bound": sampler.plan.lower_bound, "packs_per_epoch": sampler.num_packs,
        "mean_pack_fill": sum(fills) / max(1, len(fills)),
        "final_loss": stats.losses[-1] if stats.losses else None,
        "first_loss": stats.losses[0] if stats.losses else None, "losses": stats.losses, "seconds": stats.seconds,
        "peak_memory_bytes": stats.peak_memory_bytes, "backends": _backends_used(proc.device),
    }


def _backends_used(device: torch.device) -> list[dict[str, Any]]:
    """Which backend ran each op's calls on ``device`` during training, and why not the ones before it."""
    name = device_name(device)
    return [asdict(d) for d in decisions() if d.device == name]


def _pack_fills(stats: RunStats, lengths: Sequence[int], capacity: int) -> list[float]:
    """How full each packed row was (real tokens / capacity)."""
    return [sum(lengths[i] for i in group) / capacity for group in stats.groups]


def _write_metrics(proc: _Process, metrics: dict[str, Any], guard: PackingGuard | None) -> None:
    """``metrics.json`` on rank 0, with the guard's checks (and their share of the training time) when it ran."""
    if guard is not None:
        metrics["guard"] = guard.to_dict()
        if metrics.get("seconds"):
            metrics["guard"]["share_of_training_time"] = metrics["guard"]["seconds"] / metrics["seconds"]
        if proc.world > 1:  # every rank's checks (their verdicts agree; their documents and times differ)
            ranks: list[Any] = [None] * proc.world
            dist.all_gather_object(ranks, metrics["guard"])
            metrics["guard"]["ranks"] = ranks
    if proc.rank == 0:
        (proc.out / "metrics.json").write_text(json.dumps(metrics, indent=1))


class _PackedSteps:
    """Optimizer steps of packed micro-batches drawn from the sampler (what a ``DataLoader`` with
    ``batch_sampler=sampler`` and no workers yields), recording each micro-batch's example indices. With
    context parallelism each row is padded to a multiple of the group's size (twice it under the zigzag layout)
    and this rank gets its shard in ``layout``; its ``real_tokens`` are the whole row's."""

    def __init__(self, features: Sequence[dict[str, Any]], sampler: PackedBatchSampler, grad_accum: int,
                 epochs: int, groups: list[list[int]], collator: PackingCollator, cp_group: Any = None,
                 context_parallel: int = 1, layout: str = "contiguous") -> None:
        self.features, self.sampler, self.grad_accum, self.epochs, self.groups, self.collator = (
            features, sampler, grad_accum, epochs, groups, collator)
        self.cp_group, self.context_parallel, self.layout = cp_group, context_parallel, layout

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        collator = self.collator
        for epoch in range(self.sampler.epoch, self.epochs):
            self.sampler.set_epoch(epoch)
            micro: list[MicroBatch] = []
            for indices in self.sampler:
                self.groups.append(list(indices))
                batch = collator([self.features[i] for i in indices])
                micro.append(self._micro_batch(batch))
                if len(micro) == self.grad_accum:
                    yield micro
                    micro = []
            if micro:
                yield micro

    def _micro_batch(self, batch: dict[str, Any]) -> MicroBatch:
        if self.collator.max_documents and self.context_parallel == 1:  # static: the boundary tensors and their
            # host copy (a compiled graph's inputs, no Python values); under context parallelism a static row is
            # sharded like any
            return {INPUT_IDS: batch[INPUT_IDS], LABELS: batch[LABELS],
                    **{key: batch[key] for key in (CU_SEQ_LENS_Q, SEQ_IDX, POSITION_IDS, HOST_BOUNDARIES)},
                    REAL_TOKENS: batch[INPUT_IDS].shape[1] - int(batch[NUM_PAD_TOKENS])}
        if self.context_parallel == 1:
            return {INPUT_IDS: batch[INPUT_IDS], LABELS: batch[LABELS], BOUNDARIES: PackedBoundaries.from_batch(batch),
                    REAL_TOKENS: batch[INPUT_IDS].shape[1] - batch.get(NUM_PAD_TOKENS, 0)}
        shard = shard_batch(batch, self.cp_group, layout=self.layout)
        row = shard[BOUNDARIES].row  # every rank of the group counts the whole row: it trained it, with the others
        return {INPUT_IDS: shard[INPUT_IDS], LABELS: shard[LABELS], SHIFT_LABELS: shard[SHIFT_LABELS],
                BOUNDARIES: shard[BOUNDARIES], REAL_TOKENS: row.total_tokens - row.num_pad_tokens}
