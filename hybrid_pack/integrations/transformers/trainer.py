"""Hugging Face ``Trainer`` with packed batches: the distributed, resumable
:class:`~hybrid_pack.PackedBatchSampler` and the :class:`~hybrid_pack.PackingCollator`.

``Trainer`` builds a plain sampler and a padding collator; :class:`PackedTrainer` swaps in a
packed ``DataLoader`` and hands the model ready ``boundaries=`` built on the host. The sampler
yields every rank's steps interleaved (``rank=None``), the layout accelerate's
``BatchSamplerShard`` splits across processes, and a callback sets its epoch so each epoch (and a
resumed one) walks its own order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.collate import PackingCollator
from hybrid_pack.packing.sampler import PackedBatchSampler

__all__ = ["PackedTrainer", "SetSamplerEpoch"]


class SetSamplerEpoch(TrainerCallback):
    """Calls ``sampler.set_epoch`` at the start of every epoch."""

    def __init__(self, sampler: PackedBatchSampler) -> None:
        self.sampler = sampler

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sampler.set_epoch(int(state.epoch or 0))


class PackedTrainer(Trainer):
    """A ``Trainer`` whose training batches are packed rows of up to ``capacity`` tokens.

    Args:
        lengths: token count of every example of ``train_dataset``.
        capacity: tokens per packed row (``per_device_train_batch_size`` is ignored: one row per step and rank).
        collator: defaults to ``PackingCollator()``.
        *args, **kwargs: as for ``transformers.Trainer``.
    """

    def __init__(self, *args: Any, lengths: Sequence[int] | np.ndarray, capacity: int,
                 collator: PackingCollator | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packing_collator = collator or PackingCollator()
        self.packed_sampler = PackedBatchSampler(lengths, capacity, num_replicas=self.args.world_size, rank=None,
                                                 seed=self.args.seed)
        self.add_callback(SetSamplerEpoch(self.packed_sampler))

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Build the boundaries from the host batch, before it moves to the device (no device syncs later)."""
        boundaries = PackedBoundaries.from_batch(inputs) if "cu_seq_lens_q" in inputs else None
        inputs = super()._prepare_inputs(inputs)
        if boundaries is not None:
            inputs["boundaries"] = boundaries.to(self.args.device)
        return inputs

    def get_train_dataloader(self) -> DataLoader:
        loader = DataLoader(self.train_dataset, batch_sampler=self.packed_sampler, collate_fn=self.packing_collator,
                            num_workers=self.args.dataloader_num_workers, pin_memory=self.args.dataloader_pin_memory)
        return self.accelerator.prepare(loader)
