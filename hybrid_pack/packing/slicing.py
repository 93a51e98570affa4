"""Token slices of examples, for plans that truncate or split long examples.

With ``overflow="truncate"`` or ``"split"`` a pack item is ``(example_index, start, stop)``: the
tokens ``[start, stop)`` of one example. :func:`slice_example` cuts every per-token field of an
example dict; :class:`SlicedDataset` wraps a map-style dataset so that a
``DataLoader(SlicedDataset(ds), batch_sampler=PackedBatchSampler(..., overflow="split"))`` fetches
the pieces the sampler asks for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from hybrid_pack.errors import InputError
from hybrid_pack.multimodal import is_multimodal
from hybrid_pack.schema import INPUT_IDS

__all__ = ["SlicedDataset", "TokenSlice", "slice_example"]


class TokenSlice(NamedTuple):
    """A pack item that is the tokens ``[start, stop)`` of example ``example`` (a plain tuple otherwise)."""

    example: int
    start: int
    stop: int

    def __index__(self) -> int:
        """Used as an int index, by a dataset that takes only whole examples (a list, a Hugging Face ``Dataset``):
        a clear error instead of the dataset's own."""
        raise TypeError(f"{self!r}: the sampler yields token slices (overflow='truncate' or 'split'); a dataset "
                        "indexed by example cannot take them: wrap it, DataLoader(SlicedDataset(dataset), "
                        "batch_sampler=...), from hybrid_pack.packing.slicing")


def _is_per_token(value: Any, length: int) -> bool:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray, torch.Tensor)):
        return False
    return len(value) == length


def slice_example(example: Mapping[str, Any], start: int, stop: int, *,
                  length_key: str = INPUT_IDS) -> dict[str, Any]:
    """A shallow copy of ``example`` with every per-token field cut to ``[start, stop)``.

    A field is per-token when it is a sequence (not a string), numpy array or tensor with as many
    entries as ``example[length_key]``; other fields (ids, scalars, text, metadata) are kept as they are.
    A multimodal example (one with pixels or grids, docs/api.md §3b) is never cut: any slice but the whole
    example raises :class:`~hybrid_pack.errors.InputError` (an image's placeholders and pixels go together).
    """
    if length_key not in example:
        raise InputError(f"{length_key}: expected the example to have this per-token field; "
                         f"got keys {sorted(example)}")
    length = len(example[length_key])
    if not 0 <= start < stop <= length:
        raise InputError(f"start, stop: expected 0 <= start < stop <= {length} (the example's {length_key} length); "
                         f"got {start}, {stop}")
    if (start, stop) != (0, length) and is_multimodal(example):
        raise InputError(f"overflow: a multimodal example ({length} tokens, with pixels / grids) cannot be cut to "
                         f"tokens [{start}, {stop}): that would cut through its images. Pass overflow='drop' "
                         f"(counted) or 'error', or raise capacity to at least {length}")
    return {key: value[start:stop] if _is_per_token(value, length) else value for key, value in example.items()}


class SlicedDataset(Dataset):
    """A map-style dataset indexed by ``index`` or ``(index, start, stop)``.

    An int returns ``dataset[index]`` unchanged; a triple returns :func:`slice_example` of it. Wrap the
    dataset with this when the sampler or plan truncates or splits examples.
    """

    def __init__(self, dataset: Sequence[Mapping[str, Any]], *, length_key: str = INPUT_IDS) -> None:
        self.dataset = dataset
        self.length_key = length_key

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: int | tuple[int, int, int]) -> Mapping[str, Any]:
        if isinstance(item, tuple):
            index, start, stop = item
            return slice_example(self.dataset[index], start, stop, length_key=self.length_key)
        return self.dataset[item]
