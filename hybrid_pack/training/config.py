"""Settings of one training run (``hybrid-pack train``): each field declared once, with its meaning.

``hybrid-pack train`` takes every field as ``--kebab-case`` (:mod:`hybrid_pack.cli` builds the options from these
fields). A field's metadata holds its ``help``, and where they apply its ``choices`` (the values the option takes
and the config accepts) and ``metavar`` (the value's name in the usage line).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from hybrid_pack.boundaries.sharded import LAYOUTS
from hybrid_pack.data.tokenizer import TOKENIZER_FILES, has_tokenizer
from hybrid_pack.errors import InputError
from hybrid_pack.packing.plan import OVERFLOW_POLICIES
from hybrid_pack.training.reporting import REPORT_TARGETS, report_targets

DEFAULT_GUARD_EVERY = 100
"""Packed micro-batches between two checks of the runtime guard (docs/guard.md: its cost at this N)."""

DEFAULT_LOG_EVERY = 10
"""Optimizer steps between two reads of the losses (``--log-every``; docs/api.md §9b: no host read per step)."""

WEIGHT_FILES = ("*.safetensors", "*.bin")
"""What the weights of a saved Hugging Face checkpoint are named (a model directory without them starts fresh)."""

DTYPES = ("auto", "float32", "bfloat16")
"""``dtype``: ``"auto"`` is bf16 autocast where the device has it, else float32."""


@dataclass
class TrainConfig:
    """Packed supervised fine-tuning settings. Each field's meaning is its ``help``
    (``dataclasses.fields(TrainConfig)``, or ``hybrid-pack train --help``)."""

    model: str = field(default="qwen3-next-tiny", metadata={
        "help": "preset name or a local Hugging Face model directory (trained in its own tokenizer's ids)"})
    tokenizer: str | None = field(default=None, metadata={
        "help": "a folder holding the tokenizer and chat template the chats are rendered with "
                "(AutoTokenizer.from_pretrained), ids untouched; a --model directory's own when not given. A preset "
                "or a config without weights and without a tokenizer: the bundled Qwen3 tokenizer, remapped to a "
                "compact vocabulary when the model's is smaller",
        "metavar": "PATH"})
    data: str = field(default="gsm8k", metadata={
        "help": "'gsm8k' (bundled) or a JSONL file of {'messages': [...]} chats"})
    out: str = field(default="runs/train", metadata={"help": "run directory (metrics.json, plots, checkpoint)"})
    capacity: int = field(default=2048, metadata={"help": "tokens per packed row"})
    max_examples: int | None = field(default=None, metadata={"help": "use the first N examples; all when not given"})
    overflow: str = field(default=OVERFLOW_POLICIES[0], metadata={
        "help": "an example longer than --capacity: error (stop, naming it, as plan_packs), truncate (keep its "
                "first --capacity tokens), split (cut it into pieces) or drop (leave it out); counted in "
                "metrics.json",
        "choices": OVERFLOW_POLICIES})
    epochs: int = field(default=1, metadata={"help": "passes over the data (or --max-steps, whichever ends first)"})
    max_steps: int | None = field(default=None, metadata={
        "help": "stop after this many optimizer steps; the epochs' when not given"})
    grad_accum: int = field(default=1, metadata={"help": "packed rows per optimizer step"})
    lr: float = field(default=3e-3, metadata={"help": "AdamW's peak learning rate (linear warm-up, cosine decay)"})
    warmup_steps: int = field(default=10, metadata={
        "help": "optimizer steps of linear warm-up (at most a tenth of the run)"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW's weight decay"})
    min_lr_ratio: float = field(default=0.1, metadata={
        "help": "the learning rate at the end of the cosine decay, over --lr"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradients clipped to this total norm"})
    dtype: str = field(default=DTYPES[0], metadata={
        "help": "auto: bf16 autocast where the device has it", "choices": DTYPES})
    seed: int = field(default=0, metadata={
        "help": "seeds the model's weights, the packing order and the guard's documents"})
    device: str | None = field(default=None, metadata={
        "help": "cpu, cuda, cuda:1 ...; cuda if available when not given"})
    compare_padded: bool = field(default=False, metadata={
        "help": "also train the same example groups in padded batches and compare"})
    isolation_check: bool = field(default=False, metadata={"help": "run the isolation harness on the model first"})
    log_every: int = field(default=DEFAULT_LOG_EVERY, metadata={
        "help": "optimizer steps between two reads of the losses: each step's loss stays on the device and the host "
                "waits for it only every N steps (and at the first, the last and every checkpoint), when the "
                "progress bar and --report-to are updated; metrics.json still holds every step's loss",
        "metavar": "N"})
    checkpoint_every: int = field(default=0, metadata={
        "help": "optimizer steps between checkpoints; 0: only at the end"})
    resume: bool = field(default=False, metadata={
        "help": "continue from the checkpoint OUT/checkpoint/latest names"})
    guard_every: int = field(default=DEFAULT_GUARD_EVERY, metadata={
        "help": "the runtime leak guard checks the first packed micro-batch and every N-th after it against its "
                "documents run alone; 0 turns it off (docs/guard.md)",
        "metavar": "N"})
    report_to: str | list[str] = field(default="none", metadata={
        "help": "per-step metrics to TensorBoard (OUT/runs) and / or wandb, as transformers' report_to",
        "metavar": "{" + ",".join(("none", "all", *REPORT_TARGETS)) + "}"})
    fsdp: bool = field(default=False, metadata={
        "help": "under torchrun: shard every decoder block and the root with FSDP2 over all ranks (bf16 mixed "
                "precision on CUDA), with --context-parallel too; checkpoints in OUT/checkpoint/ with "
                "torch.distributed.checkpoint"})
    context_parallel: int = field(default=1, metadata={
        "help": "under torchrun: split each packed row across N ranks (docs/parallel.md)", "metavar": "N"})
    cp_layout: str = field(default=LAYOUTS[0], metadata={
        "help": "how --context-parallel splits a row: contiguous (rank r holds the r-th N-th) or zigzag (rank r "
                "holds chunks r and 2N-1-r of 2N, every rank the same causal work; rows padded to a multiple of 2N)",
        "choices": LAYOUTS})
    activation_checkpointing: bool = field(default=False, metadata={
        "help": "recompute every decoder block's forward in the backward (non-reentrant torch.utils.checkpoint): "
                "activation memory of one block's inputs per block; with --fsdp and --context-parallel too"})
    progress: bool = field(default=True, metadata={"help": "a progress bar on rank 0"})
    compile: bool = field(default=False, metadata={
        "help": "torch.compile the model on static batches: one graph for every row; with --fsdp, "
                "--context-parallel or --activation-checkpointing every decoder block is compiled (docs/compile.md)"})

    def __post_init__(self) -> None:
        for name in ("capacity", "epochs", "grad_accum", "context_parallel", "log_every"):
            if int(getattr(self, name)) < 1:
                raise InputError(f"{name}: expected a positive int; got {getattr(self, name)}")
        for name, off in (("guard_every", "the guard"), ("checkpoint_every", "checkpoints before the last step")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"{name}: expected an int >= 0 (0 turns {off} off); got {value!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise InputError(f"max_steps: expected a positive int or None; got {self.max_steps}")
        if self.max_examples is not None and self.max_examples < 1:
            raise InputError(f"max_examples: expected a positive int or None; got {self.max_examples}")
        for name in ("lr", "weight_decay", "min_lr_ratio", "max_grad_norm", "warmup_steps"):
            if not getattr(self, name) >= 0:  # NaN fails too
                raise InputError(f"{name}: expected a number >= 0; got {getattr(self, name)}")
        if self.device is not None:
            try:
                device = torch.device(self.device)
            except RuntimeError:
                raise InputError(f"device: expected cpu, cuda, cuda:1 ...; got {self.device!r}") from None
            if device.type == "cuda" and not torch.cuda.is_available():
                raise InputError(f"device: {self.device!r}, but this torch ({torch.__version__}) sees no CUDA "
                                 "device; pass cpu")
        for setting_field in fields(self):
            choices, value = setting_field.metadata.get("choices"), getattr(self, setting_field.name)
            if choices is not None and value not in choices:
                raise InputError(f"{setting_field.name}: expected one of {', '.join(map(repr, choices))}; "
                                 f"got {value!r}")
        report_targets(self.report_to)
        if self.compile and self.capacity % self.row_multiple:  # static rows are `capacity` tokens, sharded as is
            zigzag = ", twice for the zigzag layout" if self.row_multiple > self.context_parallel else ""
            raise InputError(f"capacity: with --compile every row is --capacity tokens, which must divide by "
                             f"{self.row_multiple} (the context-parallel size{zigzag}); got {self.capacity}")
        if self.out_dir.exists() and not self.out_dir.is_dir():
            raise InputError(f"out: {self.out!r} is a file; name a folder for the run (created if missing)")
        if self.data != "gsm8k" and not Path(self.data).is_file():
            raise InputError(f"data: expected 'gsm8k' or the path of a JSONL file of chats; {self.data!r} is neither")
        if self.tokenizer is not None and not has_tokenizer(self.tokenizer):
            raise InputError(f"tokenizer: {self.tokenizer!r} is not a folder holding a tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}); name the folder tokenizer.save_pretrained wrote")
        model_dir = Path(self.model)
        if (self.tokenizer is None and (model_dir / "config.json").is_file() and not has_tokenizer(model_dir)
                and any(any(model_dir.glob(pattern)) for pattern in WEIGHT_FILES)):
            raise InputError(f"model: {self.model!r} holds weights but no tokenizer (none of "
                             f"{', '.join(TOKENIZER_FILES)}); save the checkpoint's tokenizer there "
                             f"(tokenizer.save_pretrained) or name its folder with --tokenizer PATH")

    @property
    def row_multiple(self) -> int:
        """What a packed row's length must divide by: the context-parallel size, twice it under the zigzag layout
        (each rank holds two of ``2 * N`` chunks)."""
        return self.context_parallel * (2 if self.context_parallel > 1 and self.cp_layout == "zigzag" else 1)

    @property
    def chat_tokenizer(self) -> str | None:
        """The folder whose tokenizer and chat template render the chats: ``tokenizer``, else a model directory's
        own when it holds one; None for the bundled Qwen3 tokenizer (a preset, or a config without weights and
        without a tokenizer)."""
        if self.tokenizer is not None:
            return self.tokenizer
        return self.model if (Path(self.model) / "config.json").is_file() and has_tokenizer(self.model) else None

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
