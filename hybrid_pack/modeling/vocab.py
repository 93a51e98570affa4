"""A compact vocabulary for tiny models: the tokenizer ids a corpus actually uses.

The Qwen3 tokenizer has 151,669 ids; at hidden size 128 a full-vocabulary embedding and head would
dominate a CPU demo (and its ``[T, 151669]`` logits would dominate memory). :class:`VocabRemap`
keeps the ``size - 1`` most frequent ids of a training corpus as compact ids ``1..size-1`` and sends
every other id to compact id 0 (``<unk>``). It belongs to the data side: remap ``input_ids`` and
``labels`` before collating, and map generated ids back with :meth:`VocabRemap.decode`.
The ignore index ``-100`` passes through unchanged. :func:`expand_vocabulary` gives a model trained on
compact ids the tokenizer's ids back, so it is saved and used like any other.

Only models trained in the bundled Qwen3 tokenizer's ids (presets, configs without weights) go through it: a
saved checkpoint trains in its own tokenizer's ids, untouched (``hybrid-pack train --model DIR``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from os import PathLike
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from hybrid_pack.errors import InputError
from hybrid_pack.schema import INPUT_IDS, LABELS

__all__ = ["UNK_ID", "VocabRemap", "expand_vocabulary"]

UNK_ID = 0
Ids = TypeVar("Ids", list, np.ndarray, torch.Tensor)


class VocabRemap:
    """Tokenizer ids <-> compact ids ``0..size-1`` (0 is ``<unk>``).

    Args:
        kept_ids: tokenizer ids that get compact ids ``1, 2, ...`` in this order (distinct, >= 0).
    """

    def __init__(self, kept_ids: Sequence[int] | np.ndarray) -> None:
        kept = np.asarray(kept_ids, dtype=np.int64)
        if kept.ndim != 1 or kept.size == 0:
            raise InputError(f"kept_ids: expected a non-empty 1-D list of token ids; got shape {list(kept.shape)}")
        if (kept < 0).any() or np.unique(kept).size != kept.size:
            raise InputError("kept_ids: expected distinct token ids >= 0")
        self.kept_ids = kept
        self._to_compact = np.full(int(kept.max()) + 1, UNK_ID, dtype=np.int64)
        self._to_compact[kept] = np.arange(1, kept.size + 1)

    @property
    def size(self) -> int:
        """Compact vocabulary size (the model's ``vocab_size``), ``<unk>`` included."""
        return int(self.kept_ids.size) + 1

    @classmethod
    def from_corpus(cls, sequences: Iterable[Sequence[int] | np.ndarray], size: int) -> VocabRemap:
        """Keep the ``size - 1`` most frequent ids of ``sequences`` (ties: lower id first)."""
        if size < 2:
            raise InputError(f"size: expected at least 2 (<unk> plus one token); got {size}")
        counts = np.zeros(0, dtype=np.int64)
        for seq in sequences:
            c = np.bincount(np.asarray(seq, dtype=np.int64))
            if c.size > counts.size:
                counts = np.pad(counts, (0, c.size - counts.size))
            counts[: c.size] += c
        used = np.flatnonzero(counts)
        if used.size == 0:
            raise InputError("sequences: expected at least one token")
        order = used[np.argsort(-counts[used], kind="stable")]
        return cls(order[: size - 1])

    def encode(self, ids: Ids) -> Ids:
        """Tokenizer ids (list, array or tensor) -> compact ids of the same type; -100 stays -100."""
        arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids, dtype=np.int64)
        inside = (arr >= 0) & (arr < self._to_compact.size)
        out = np.where(inside, self._to_compact[np.where(inside, arr, 0)], np.where(arr < 0, arr, UNK_ID))
        return _like(ids, out)

    def decode(self, ids: Ids, unk_token_id: int) -> Ids:
        """Compact ids -> tokenizer ids; ``<unk>`` becomes ``unk_token_id``; -100 stays -100."""
        arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids, dtype=np.int64)
        if (arr >= self.size).any():
            raise InputError(f"ids: expected compact ids below size={self.size}; got {int(arr.max())}")
        table = np.concatenate([[unk_token_id], self.kept_ids])
        out = np.where(arr < 0, arr, table[np.clip(arr, 0, None)])
        return _like(ids, out)

    def encode_example(self, example: Mapping[str, Any], keys: Sequence[str] = (INPUT_IDS, LABELS)
                       ) -> dict[str, Any]:
        """A copy of a dataset example with the token keys that are present remapped."""
        return {k: self.encode(v) if k in keys else v for k, v in example.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"kept_ids": self.kept_ids.tolist()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> VocabRemap:
        return cls(data["kept_ids"])

    def save(self, path: str | PathLike[str]) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | PathLike[str]) -> VocabRemap:
        return cls.from_dict(json.loads(Path(path).read_text()))


@torch.no_grad()
def expand_vocabulary(model: torch.nn.Module, remap: VocabRemap, vocab_size: int) -> None:
    """Turn a model trained on ``remap``'s compact ids into one taking the tokenizer's ``vocab_size`` ids, in place.

    Row ``i`` of the input embedding and of the output head becomes the compact row of tokenizer id ``i``: a
    kept id keeps its own row, every other id gets the ``<unk>`` row. Fed tokenizer ids, the model then gives
    the logits the compact model gave on their compact ids, over tokenizer ids: each kept id its own logit,
    each other id the ``<unk>`` logit. The logits, not the probabilities: a softmax over all ``vocab_size`` ids
    counts the ``<unk>`` logit once per other id (a loss, perplexity or sample differs from the compact model's).
    A tied head stays tied; ``model.config.vocab_size`` becomes
    ``vocab_size``. Works on any model with ``get_input_embeddings`` / ``get_output_embeddings`` (native or
    Hugging Face).
    """
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    rows = torch.as_tensor(remap.encode(np.arange(vocab_size, dtype=np.int64)), device=embed.weight.device)
    tied = head.weight is embed.weight
    embed.weight = torch.nn.Parameter(embed.weight[rows])
    embed.num_embeddings = vocab_size
    head.weight = embed.weight if tied else torch.nn.Parameter(head.weight[rows.to(head.weight.device)])
    if getattr(head, "bias", None) is not None:
        head.bias = torch.nn.Parameter(head.bias[rows.to(head.bias.device)])
    head.out_features = vocab_size
    model.config.vocab_size = vocab_size


def _like(original: Ids, values: np.ndarray) -> Ids:
    if isinstance(original, torch.Tensor):
        return torch.from_numpy(values.astype(np.int64)).to(device=original.device, dtype=original.dtype)
    if isinstance(original, np.ndarray):
        return values.astype(original.dtype, copy=False)
    return values.tolist()
