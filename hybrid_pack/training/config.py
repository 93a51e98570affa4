"""Settings of one training run (``hybrid-pack train``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybrid_pack.errors import InputError
from hybrid_pack.packing.plan import OVERFLOW_POLICIES
from hybrid_pack.training.reporting import report_targets

DEFAULT_GUARD_EVERY = 100
"""Packed micro-batches between two checks of the runtime guard (docs/guard.md: its cost at this N)."""


@dataclass
class TrainConfig:
    """Packed supervised fine-tuning settings.

    Attributes:
        model: a preset name (``qwen3-next-tiny``) or a local Hugging Face model directory.
        data: ``"gsm8k"`` (bundled) or the path of a JSONL file of chats (``{"messages": [...]}``).
        out: run directory (metrics.json, plots, checkpoint).
        capacity: tokens per packed row.
        max_examples: use the first N examples (None = all).
        overflow: an example longer than ``capacity``: ``"error"`` (default, as :func:`~hybrid_pack.plan_packs`:
            raise naming it), ``"truncate"`` (keep its first ``capacity`` tokens), ``"split"`` (pieces of at
            most ``capacity`` tokens, each its own document) or ``"drop"``; every one is counted in metrics.json.
        epochs / max_steps: stop after the epochs or the optimizer steps, whichever comes first.
        grad_accum: packed rows per optimizer step.
        lr, warmup_steps, weight_decay, min_lr_ratio: AdamW with linear warm-up and cosine decay.
        dtype: ``"auto"`` (bf16 autocast where the device has it, else float32), ``"float32"`` or ``"bfloat16"``.
        compare_padded: also train the same examples, in the same order and groups, in padded batches.
        isolation_check: run the cross-contamination harness on the model first.
        checkpoint_every: optimizer steps between checkpoints (0 = only at the end).
        resume: continue from ``out/checkpoint.pt`` (``out/checkpoint/`` with ``fsdp``).
        report_to: per-step metrics to ``"tensorboard"`` and / or ``"wandb"`` (a name or a list), ``"all"``
            installed, or ``"none"`` (default), as ``transformers.TrainingArguments.report_to``.
        guard_every: the runtime guard (:class:`~hybrid_pack.testing.PackingGuard`) checks the first packed
            micro-batch and every N-th after it against its documents run alone; 0 turns it off.
        fsdp: under torchrun, shard the model with FSDP2 (every decoder block and the root) instead of DDP,
            checkpoints with ``torch.distributed.checkpoint`` (:mod:`hybrid_pack.training.sharded`).
        context_parallel: ranks that share each packed row under torchrun (docs/parallel.md); the others
            are data-parallel replicas. Above 1 the guard is off (it checks whole rows).
        compile: ``torch.compile`` the model's forward and feed it static batches (docs/compile.md): every row
            ``capacity`` tokens and at most as many documents as the fullest pack of the plan, one graph.
    """

    model: str = "qwen3-next-tiny"
    data: str = "gsm8k"
    out: str = "runs/train"
    capacity: int = 2048
    max_examples: int | None = None
    overflow: str = "error"
    epochs: int = 1
    max_steps: int | None = None
    grad_accum: int = 1
    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.01
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    dtype: str = "auto"
    seed: int = 0
    device: str | None = None
    compare_padded: bool = False
    isolation_check: bool = False
    checkpoint_every: int = 0
    resume: bool = False
    guard_every: int = DEFAULT_GUARD_EVERY
    report_to: str | list[str] = "none"
    log_every: int = 1
    fsdp: bool = False
    context_parallel: int = 1
    progress: bool = True
    compile: bool = False

    def __post_init__(self) -> None:
        for name in ("capacity", "epochs", "grad_accum", "context_parallel"):
            if int(getattr(self, name)) < 1:
                raise InputError(f"{name}: expected a positive int; got {getattr(self, name)}")
        if isinstance(self.guard_every, bool) or not isinstance(self.guard_every, int) or self.guard_every < 0:
            raise InputError(f"guard_every: expected an int >= 0 (0 turns the guard off); got {self.guard_every!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise InputError(f"max_steps: expected a positive int or None; got {self.max_steps}")
        if self.max_examples is not None and self.max_examples < 1:
            raise InputError(f"max_examples: expected a positive int or None; got {self.max_examples}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise InputError(f"overflow: expected one of {', '.join(OVERFLOW_POLICIES)}; got {self.overflow!r}")
        report_targets(self.report_to)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise InputError(f"dtype: expected 'auto', 'float32' or 'bfloat16'; got {self.dtype!r}")
        if self.fsdp and self.context_parallel > 1:
            raise InputError("fsdp: FSDP2 together with context_parallel > 1 is not supported yet (its gradient "
                             "reduction would average over the context-parallel ranks); use one of the two")
        if self.compile and self.context_parallel > 1:
            raise InputError("compile: static batches together with context_parallel > 1 are not supported yet (a "
                             "shard's boundaries are built on the host); use one of the two")
        if self.compile and self.fsdp:
            raise InputError("compile: a compiled forward under FSDP2 is not tested yet (its hooks run inside the "
                             "graph); use one of the two")
        if self.data != "gsm8k" and not Path(self.data).is_file():
            raise InputError(f"data: expected 'gsm8k' or the path of a JSONL file of chats; {self.data!r} is neither")

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
