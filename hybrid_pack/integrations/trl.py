"""TRL's ``SFTTrainer`` with packed batches that never mix documents: :class:`PackedSFTTrainer` (and
TRL's ``GRPOTrainer`` scoring completions on packed rows: :class:`PackedGRPOTrainer`, in :mod:`.trl_grpo`; TRL's
``DPOTrainer`` scoring chosen and rejected sequences on packed rows: :class:`PackedDPOTrainer`, in :mod:`.trl_dpo`;
TRL's ``RLOOTrainer`` likewise: :class:`PackedRLOOTrainer`, in :mod:`.trl_rloo`).

One line changes in a TRL script::

    trainer = PackedSFTTrainer(model=model, args=SFTConfig(packing=True, max_length=4096),
                               train_dataset=dataset, processing_class=tokenizer)   # was SFTTrainer(...)

Every batch goes through :class:`~hybrid_pack.PackingCollator` and the model is patched
(:func:`~hybrid_pack.integrations.transformers.patch_model`), whatever TRL does to it afterwards or
before (its fused LM head, PEFT, gradient checkpointing). The packing is TRL's (``packing=True``: its
best-fit-decreasing rows, each with the ``seq_lengths`` of its documents) or hybrid_pack's
(``capacity=N`` with ``packing=False``: :class:`~hybrid_pack.PackedBatchSampler` over the tokenized
examples). TRL refuses a custom collator whenever its padding-free mode is on, so the trainer builds
TRL's own and swaps the packing collator in once TRL is done with its checks.

The loss is TRL's: a token mean over every labelled token of the batch (or of the accumulated batches,
``num_items_in_batch``), with the first token of every document never a target, so a packed batch gives
the loss and gradients of the same examples unpacked.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from hybrid_pack.collate import PackingCollator
from hybrid_pack.errors import InputError, MissingExtraError
from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.trainer import PackedBatches, ResumesRenamedWeights
from hybrid_pack.packing.sampler import PackedBatchSampler
from hybrid_pack.schema import INPUT_IDS, LABELS, POSITION_IDS

try:
    import accelerate  # noqa: F401  (imported first: trl's lazy imports would wrap a missing one in a RuntimeError)
    import transformers  # noqa: F401
    from datasets import Dataset
    from trl import SFTTrainer
except ImportError as err:
    raise MissingExtraError("PackedSFTTrainer", "trl", err) from err

from hybrid_pack.integrations.trl_dpo import PackedDPOTrainer
from hybrid_pack.integrations.trl_grpo import TESTED_TRL, PackedGRPOTrainer
from hybrid_pack.integrations.trl_rloo import PackedRLOOTrainer
from hybrid_pack.integrations.trl_vlm import VisionLanguagePackingCollator, vision_packing_collator

__all__ = ["PackedDPOTrainer", "PackedGRPOTrainer", "PackedRLOOTrainer", "PackedRowsCollator", "PackedSFTTrainer",
           "TESTED_TRL", "TRL_SEQ_LENGTHS"]

logger = logging.getLogger(__name__)

TRL_SEQ_LENGTHS = "seq_lengths"
"""TRL's dataset column listing the lengths of the documents its packing put in one row."""

Row = Mapping[str, Any]


class PackedRowsCollator:
    """Rows of a TRL dataset -> one packed row, through :class:`~hybrid_pack.PackingCollator`.

    A row with ``seq_lengths`` (TRL's packing) is split into its documents; any other row is one
    document. ``input_ids``, ``labels`` and the collator's ``extra_token_keys`` are split; other keys
    are dropped. The output is :class:`~hybrid_pack.PackingCollator`'s: ``input_ids [1, T]`` and the
    boundary keys, every document's first label ``-100``.

    Args:
        collator: the packing collator (default ``PackingCollator()``).
    """

    def __init__(self, collator: PackingCollator | None = None) -> None:
        if collator is not None and not isinstance(collator, PackingCollator):
            raise InputError(f"collator: expected a hybrid_pack.PackingCollator; got {type(collator).__name__}")
        if collator is not None and collator.return_tensors != "pt":
            raise InputError(f"collator: return_tensors={collator.return_tensors!r}; a trainer feeds the model "
                             "torch tensors: leave return_tensors at 'pt'")
        self.collator = collator or PackingCollator()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.collator!r})"

    @property
    def token_keys(self) -> tuple[str, ...]:
        """The per-token columns a row may carry."""
        return (INPUT_IDS, LABELS, *self.collator.extra_token_keys)

    def documents(self, row: Row, index: int = 0) -> list[dict[str, Any]]:
        """The documents of one dataset row (``index`` names the row in errors)."""
        keys = [key for key in self.token_keys if row.get(key) is not None]
        lengths = row.get(TRL_SEQ_LENGTHS)
        if lengths is None:
            return [{key: row[key] for key in keys}]
        lengths = [int(n) for n in lengths]
        total = len(row[INPUT_IDS])
        if sum(lengths) != total or any(n < 1 for n in lengths):
            raise InputError(f"rows[{index}].{TRL_SEQ_LENGTHS}: expected positive lengths summing to the row's "
                             f"{total} tokens; got {lengths} (sum {sum(lengths)})")
        docs, start = [], 0
        for n in lengths:
            docs.append({key: row[key][start:start + n] for key in keys})
            start += n
        return docs

    def __call__(self, rows: Sequence[Row]) -> dict[str, Any]:
        return self.collator([self.documents(row, i) for i, row in enumerate(rows)])


class PackedSFTTrainer(PackedBatches, ResumesRenamedWeights, SFTTrainer):
    """``trl.SFTTrainer`` training on packed rows that keep their documents apart.

    Takes every argument of ``SFTTrainer``; ``data_collator`` may only be a
    :class:`~hybrid_pack.PackingCollator` (its settings are used; default ``PackingCollator()``).

    Args:
        capacity: pack the tokenized examples with hybrid_pack (``PackedBatchSampler``, best fit
            decreasing) into rows of at most this many tokens, one row per step and rank
            (``per_device_train_batch_size`` is then ignored). Needs ``packing=False`` in the config,
            and every example no longer than ``capacity``. Without it, each batch of
            ``per_device_train_batch_size`` rows (TRL's packed rows with ``packing=True``) becomes one
            packed row.
        *args, **kwargs: as for ``trl.SFTTrainer``.

    A vision dataset (``image`` / ``images`` columns, a processor as ``processing_class``; TRL's defaults
    ``packing=False``, ``padding_free=False``): each batch of ``per_device_train_batch_size`` examples is processed
    one example at a time by TRL's own collator and packed into one row
    (:class:`~hybrid_pack.integrations.trl_vlm.VisionLanguagePackingCollator`), with M-RoPE positions per example
    for a model that has them (``data_collator`` then needs ``position_ids_fn``).
    """

    def __init__(self, *args: Any, capacity: int | None = None, **kwargs: Any) -> None:
        collator = kwargs.pop("data_collator", None)
        if collator is not None and not isinstance(collator, PackingCollator):
            raise InputError(f"data_collator: PackedSFTTrainer collates with hybrid_pack.PackingCollator; got "
                             f"{type(collator).__name__} (pass a PackingCollator, or leave data_collator unset)")
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(config, "packing_strategy", None) == "wrapped" and (config.packing or config.eval_packing):
            raise InputError("packing_strategy: 'wrapped' cuts documents and joins their pieces into rows that "
                             f"record no document lengths ({TRL_SEQ_LENGTHS}), so documents would share one segment; "
                             "use 'bfd' or 'bfd_split' (each row lists its documents), or packing=False and "
                             "eval_packing=False")
        super().__init__(*args, **kwargs)
        if capacity is not None and self._is_vision_dataset:
            raise InputError("capacity: TRL turns a vision dataset's images into pixels batch by batch, so no "
                             "example's length is known up front; leave capacity unset (each batch of "
                             "per_device_train_batch_size examples becomes one packed row)")
        if capacity is not None and self.args.packing:
            raise InputError("capacity: hybrid_pack packs the examples itself; set packing=False in SFTConfig "
                             "(packing=True packs them with TRL first)")
        if capacity is not None and not isinstance(self.train_dataset, Dataset):
            raise InputError(f"capacity: packing needs every example's length up front; got a "
                             f"{type(self.train_dataset).__name__} (pass a datasets.Dataset, or use packing=True)")
        if self._is_vision_dataset:
            self.data_collator = self.packing_collator = VisionLanguagePackingCollator(
                self.data_collator, vision_packing_collator(self.model, collator))
        else:
            self.data_collator = self.packing_collator = PackedRowsCollator(collator)
        patch_model(self.model)
        if capacity is not None:
            lengths = [len(ids) for ids in self.train_dataset[INPUT_IDS]]
            longer = [i for i, n in enumerate(lengths) if n > capacity]
            if longer:
                raise InputError(f"capacity: example {longer[0]} has {lengths[longer[0]]} tokens, more than "
                                 f"capacity={capacity} ({len(longer)} example(s) affected); raise capacity, or set "
                                 f"SFTConfig(max_length={capacity}) for TRL to truncate the examples to it")
            self.use_packed_sampler(PackedBatchSampler(lengths, capacity, num_replicas=self.args.world_size, rank=None,
                                                       seed=self.args.seed))

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        """TRL's loss. TRL counts a padding-free row's tokens (its ``num_tokens`` metric) as ``position_ids.size(1)``,
        which is 1 for M-RoPE positions ``[3, 1, T]``: such a row counts ``T`` here."""
        counted = self._total_train_tokens
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        positions = inputs.get(POSITION_IDS)
        if self.model.training and positions is not None and positions.dim() == 3:
            tokens = torch.tensor(positions.shape[-1], device=positions.device)
            tokens = self.accelerator.gather_for_metrics(tokens).sum().item()
            self._total_train_tokens = counted + tokens // self._tp_size
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return loss

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, packing: bool,
                         formatting_func: Callable[[dict], str] | None, dataset_name: str) -> Any:
        """TRL's preparation, with what it cuts counted and shown: TRL truncates every example to ``max_length``
        (without packing, then drops those left with no label; with ``packing_strategy="bfd"``, when it packs),
        silently. The examples are tokenized first without the cut, counted, then prepared by TRL as they would
        have been (a streamed dataset is not counted)."""
        if not isinstance(dataset, Dataset) or args.max_length is None or (packing and args.packing_strategy != "bfd"):
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        whole = copy.copy(args)
        whole.max_length, whole.shuffle_dataset = None, False
        tokenized = super()._prepare_dataset(dataset, processing_class, whole, False, formatting_func, dataset_name)
        prepared = super()._prepare_dataset(tokenized, processing_class, args, packing, None, dataset_name)
        over = [n - args.max_length for n in map(len, tokenized[INPUT_IDS]) if n > args.max_length]
        dropped = 0 if packing else len(tokenized) - len(prepared)
        if over or dropped:
            logger.warning("%s dataset: TRL cut %d tokens from the %d of %d examples longer than max_length=%d%s%s",
                           dataset_name, sum(over), len(over), len(tokenized), args.max_length,
                           f", then dropped {dropped} examples left without a label" if dropped else "",
                           " (packing_strategy='bfd_split' keeps every token)" if packing else "")
        return prepared

    def _set_signature_columns_if_needed(self) -> None:
        """Keep the collator's extra per-token columns too (TRL keeps ``input_ids``, ``labels``, ``seq_lengths``)."""
        super()._set_signature_columns_if_needed()
        extra = [key for key in self.data_collator.collator.extra_token_keys if key not in self._signature_columns]
        self._signature_columns = [*self._signature_columns, *extra]
