"""The padded baseline: the same examples batched the usual way, padded to their longest.

This is what ``transformers.DataCollatorWithPadding`` does for a causal LM (right padding, labels
-100 on padding); it lets ``--compare-padded`` measure what packing saves on the same data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybrid_pack.errors import InputError
from hybrid_pack.schema import ATTENTION_MASK, IGNORE_INDEX, INPUT_IDS, LABELS


class PaddingCollator:
    """Right-pad a list of examples to their longest.

    Returns ``input_ids`` int64 ``[B, L]`` (``pad_token_id`` on padding), ``labels`` int64 ``[B, L]``
    (-100 on padding and on each example's first token, as the packed collator does), and
    ``attention_mask`` int64 ``[B, L]``.
    """

    def __init__(self, pad_token_id: int = 0) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise InputError("features: expected at least one example")
        lengths = [len(f[INPUT_IDS]) for f in features]
        rows, width = len(features), max(lengths)
        ids = np.full((rows, width), self.pad_token_id, dtype=np.int64)
        labels = np.full((rows, width), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((rows, width), dtype=np.int64)
        for r, (f, n) in enumerate(zip(features, lengths)):
            ids[r, :n] = np.asarray(f[INPUT_IDS], dtype=np.int64)
            labels[r, :n] = np.asarray(f.get(LABELS, f[INPUT_IDS]), dtype=np.int64)
            labels[r, 0] = IGNORE_INDEX
            mask[r, :n] = 1
        return {INPUT_IDS: torch.from_numpy(ids), LABELS: torch.from_numpy(labels),
                ATTENTION_MASK: torch.from_numpy(mask)}
