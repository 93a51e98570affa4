"""TRL's vision-language SFT on packed rows: :class:`VisionLanguagePackingCollator`, which
:class:`~hybrid_pack.integrations.trl.PackedSFTTrainer` swaps in for TRL's collator on a dataset of images.

TRL's ``DataCollatorForVisionLanguageModeling`` calls the processor once per batch, padding the examples to one
length. Here the same TRL collator (same processor, chat template, truncation and label rules) runs on each example
alone, so every sample comes out as the processor returns one sample (``input_ids``, ``labels``,
``mm_token_type_ids`` ``[L]``, its own ``pixel_values`` and ``image_grid_thw``), and
:class:`~hybrid_pack.PackingCollator` packs them into one row with every sample's own positions (M-RoPE:
``position_ids_fn=mrope_position_ids(model)``) and the boundary keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hybrid_pack.collate import PackingCollator
from hybrid_pack.errors import InputError, MissingExtraError
from hybrid_pack.integrations.transformers.trainer import model_position_ids_fn
from hybrid_pack.schema import ATTENTION_MASK, INPUT_IDS, LABELS, MM_TOKEN_TYPE_IDS

try:
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling
except ImportError as err:
    raise MissingExtraError("VisionLanguagePackingCollator", "trl", err) from err

__all__ = ["VisionLanguagePackingCollator", "vision_packing_collator"]

Example = Mapping[str, Any]


class VisionLanguagePackingCollator:
    """Examples of a TRL vision dataset (``images`` / ``image`` with ``messages``, ``text`` or ``prompt`` /
    ``completion``) -> one packed row, each example processed alone by TRL's own collator.

    Args:
        processing: TRL's ``DataCollatorForVisionLanguageModeling`` (the trainer's); it is used with
            ``pad_to_multiple_of=None`` (one example needs no padding; the row's padding is ``collator``'s).
        collator: the packing collator; for an M-RoPE model it needs ``position_ids_fn``
            (:func:`vision_packing_collator`).

    The output is :class:`~hybrid_pack.PackingCollator`'s for the processed samples: ``input_ids``, ``labels``
    (TRL's, every sample's first label ``-100``), ``mm_token_type_ids`` int64 ``[1, T]``, ``position_ids``
    (``[3, 1, T]`` with M-RoPE), the pixels and grids of every sample in order, and the boundary keys. A key the
    processor returns that the packing collator does not take (``token_type_ids``, ...) raises its
    :class:`~hybrid_pack.errors.InputError`, naming it.
    """

    def __init__(self, processing: DataCollatorForVisionLanguageModeling, collator: PackingCollator) -> None:
        if not isinstance(processing, DataCollatorForVisionLanguageModeling):
            raise InputError(f"processing: expected TRL's DataCollatorForVisionLanguageModeling; got "
                             f"{type(processing).__name__}")
        if not isinstance(collator, PackingCollator) or collator.return_tensors != "pt":
            raise InputError(f"collator: expected a hybrid_pack.PackingCollator with return_tensors='pt'; got "
                             f"{collator!r}")
        self.processing = dataclasses.replace(processing, pad_to_multiple_of=None)
        self.collator = collator

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.collator!r})"

    @property
    def token_keys(self) -> tuple[str, ...]:
        """The per-token keys of a processed sample (``[1, L]`` from TRL's collator, ``[L]`` here)."""
        return (INPUT_IDS, LABELS, ATTENTION_MASK, MM_TOKEN_TYPE_IDS, *self.collator.extra_token_keys)

    def sample(self, example: Example) -> dict[str, Any]:
        """One example processed alone: per-token keys ``[L]``, the pixels and grids as the processor gives them."""
        output = self.processing([dict(example)])   # TRL pops "image" from the example it gets: give it a copy
        sample = {}
        for key, value in output.items():
            if key in self.token_keys and isinstance(value, torch.Tensor) and value.dim() == 2:
                value = value[0]
            sample[key] = value
        return sample

    def __call__(self, examples: Sequence[Example]) -> dict[str, Any]:
        return self.collator([self.sample(example) for example in examples])


def vision_packing_collator(model: Any, collator: PackingCollator | None) -> PackingCollator:
    """The packing collator for ``model``'s vision-language rows: ``collator`` as given, or by default
    ``PackingCollator(position_ids_fn=mrope_position_ids(model))`` for a model that numbers its tokens with M-RoPE
    (``PackingCollator()`` for one with 1-D positions).

    Raises:
        InputError: ``collator`` was given without ``position_ids_fn`` for an M-RoPE model (its restarting 1-D
            positions are not the model's once a sample has an image).
    """
    rule = model_position_ids_fn(model)
    if collator is None:
        return PackingCollator(position_ids_fn=rule)
    if rule is not None and collator.position_ids_fn is None:
        raise InputError(f"data_collator: {rule.model_class.__name__} numbers its tokens with M-RoPE; pass "
                         "PackingCollator(position_ids_fn=mrope_position_ids(model), ...) (from "
                         "hybrid_pack.mrope), or leave data_collator unset")
    return collator
