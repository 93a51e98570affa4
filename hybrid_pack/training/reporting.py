"""``--report-to``: per-step training metrics to TensorBoard and / or Weights & Biases.

The convention is ``transformers.TrainingArguments.report_to``'s: ``"none"`` (the default), ``"all"``
(every integration installed), one name or a list of names; the metrics carry the same names
(``train/loss``, ``train/learning_rate``) plus ``train/tokens_per_second`` (real tokens, padding excluded).
TensorBoard writes event files under ``OUT/runs`` (``tensorboard --logdir OUT/runs``); wandb logs to the
project in ``WANDB_PROJECT`` (default ``hybrid-pack``), offline with ``WANDB_MODE=offline``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybrid_pack.errors import InputError

REPORT_TARGETS = ("tensorboard", "wandb")
"""Integrations ``report_to`` may name, each installed with the extra of the same name."""


def report_targets(report_to: str | Sequence[str]) -> tuple[str, ...]:
    """``report_to`` as a tuple of :data:`REPORT_TARGETS` (``"none"`` -> none, ``"all"`` -> every one installed).

    Raises:
        InputError: an unknown name, or an integration whose package is not installed (naming the extra).
    """
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if names in (["none"], []):
        return ()
    if names == ["all"]:
        return tuple(name for name in REPORT_TARGETS if importlib.util.find_spec(name) is not None)
    unknown = [name for name in names if name not in REPORT_TARGETS]
    if unknown:
        raise InputError(f"report_to: expected 'none', 'all' or names from {list(REPORT_TARGETS)}; got {unknown[0]!r}")
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise InputError(f"report_to: {name!r} needs the {name} package; pip install 'hybrid_pack[{name}]' "
                             f"(or pip install {name})")
    return tuple(dict.fromkeys(names))


class Reporter:
    """Sends ``{name: value}`` of every optimizer step to the integrations of ``targets`` (checked by
    :func:`report_targets`); close it at the end."""

    def __init__(self, targets: Sequence[str], out: Path, config: dict[str, Any]) -> None:
        self.writers: list[Any] = []
        self.runs: list[Any] = []
        for target in targets:
            if target == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self.writers.append(SummaryWriter(log_dir=str(out / "runs")))
            else:
                import wandb

                self.runs.append(wandb.init(project=os.environ.get("WANDB_PROJECT", "hybrid-pack"), dir=str(out),
                                            config=config))

    def log(self, step: int, values: dict[str, float]) -> None:
        for writer in self.writers:
            for name, value in values.items():
                writer.add_scalar(name, value, step)
        for run in self.runs:
            run.log(values, step=step)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        for run in self.runs:
            run.finish()
