"""PackingCollator: tokenized examples -> one packed row ``[1, T]`` with its document boundaries.

The output holds the keys Hugging Face models take for padding-free training (``input_ids``,
``labels``, restarting ``position_ids``, ``seq_idx``, ``cu_seq_lens_q/k``, ``max_length_q/k``),
so ``model(**collator(features))`` works. Each per-token key is built with one allocation and no
per-token Python: 1-D tensors are joined by a single ``torch.cat``; Python lists are written
straight into the output buffer with :func:`struct.pack_into`, the fastest conversion of Python
ints / floats measured (``benchmarks/bench_collator.py``). Boundaries come from
:meth:`PackedBoundaries.from_lengths`.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["FLOAT_TOKEN_KEYS", "IGNORE_INDEX", "PackingCollator"]

IGNORE_INDEX = -100
"""Label value the loss ignores (the ``torch.nn.CrossEntropyLoss`` default)."""

FLOAT_TOKEN_KEYS = frozenset({"advantages", "old_logprobs"})
"""Extra per-token keys that are always float32; other extra keys are int64 unless given as floats."""

_BUILT_KEYS = frozenset({"input_ids", "labels", "position_ids", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k",
                         "max_length_q", "max_length_k", "num_pad_tokens"})

Feature = Mapping[str, Any]


class PackingCollator:
    """Flatten a list of examples (or a list of packs of examples) into one packed row.

    Args:
        separator_id: label of the first token of every document and of padding, so no token is
            trained to predict across a boundary.
        pad_to_multiple_of: pad ``T`` up to a multiple of this with one trailing padding segment.
        pack_length: pad ``T`` up to exactly this; more tokens than this raise ``ValueError``.
            Given together with ``pad_to_multiple_of``, it must be a multiple of it.
        pad_token_id: ``input_ids`` value of padding tokens.
        extra_token_keys: per-token keys concatenated like ``input_ids`` when the features carry
            them (every feature or none); padding gets 0. ``advantages`` and ``old_logprobs`` come
            out float32; any other key int64, or float32 when given as floats.

    ``__call__(features)`` returns, for ``T`` tokens (padding included) in ``S`` segments
    (the documents, plus the padding segment if any):

    - ``input_ids``, ``labels``, ``position_ids``: int64 ``[1, T]``;
    - ``seq_idx``: int32 ``[1, T]``; ``cu_seq_lens_q`` and ``cu_seq_lens_k``: int32 ``[S + 1]``
      (one tensor under both names);
    - ``max_length_q``, ``max_length_k``: Python int, the longest segment;
    - every extra key present: float32 or int64 ``[1, T]``;
    - ``num_pad_tokens``: Python int, only when padding was added.

    Keys other than ``input_ids``, ``labels`` and ``extra_token_keys`` are ignored (the boundaries
    replace ``attention_mask``). Tensors come out on the CPU.
    """

    def __init__(
        self,
        *,
        separator_id: int = IGNORE_INDEX,
        pad_to_multiple_of: int | None = None,
        pack_length: int | None = None,
        pad_token_id: int = 0,
        extra_token_keys: Sequence[str] = ("response_mask", "tool_mask", "advantages", "old_logprobs"),
    ) -> None:
        for name, value in (("pad_to_multiple_of", pad_to_multiple_of), ("pack_length", pack_length)):
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name}: expected a positive int or None; got {value!r}")
        if pad_to_multiple_of is not None and pack_length is not None and pack_length % pad_to_multiple_of:
            raise ValueError(f"pack_length: expected a multiple of pad_to_multiple_of={pad_to_multiple_of}; got "
                             f"{pack_length} (pass only one of them, or make pack_length a multiple)")
        for name, value in (("separator_id", separator_id), ("pad_token_id", pad_token_id)):
            if not _is_int(value):
                raise ValueError(f"{name}: expected an int; got {value!r}")
        if isinstance(extra_token_keys, str):
            raise ValueError(f"extra_token_keys: expected a sequence of key names; got the string "
                             f"{extra_token_keys!r} (wrap it: ({extra_token_keys!r},))")
        clashes = sorted(set(extra_token_keys) & _BUILT_KEYS)
        if clashes:
            raise ValueError(f"extra_token_keys: {clashes} are built by the collator itself; remove them")
        self.separator_id = int(separator_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pack_length = pack_length
        self.pad_token_id = int(pad_token_id)
        self.extra_token_keys = tuple(extra_token_keys)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(separator_id={self.separator_id}, "
                f"pad_to_multiple_of={self.pad_to_multiple_of}, pack_length={self.pack_length}, "
                f"pad_token_id={self.pad_token_id}, extra_token_keys={self.extra_token_keys})")

    def __call__(self, features: Sequence[Feature] | Sequence[Sequence[Feature]]) -> dict[str, Any]:
        docs = _flatten(features)
        if not all("input_ids" in doc for doc in docs):
            index = next(i for i, doc in enumerate(docs) if "input_ids" not in doc)
            raise ValueError(f"features[{index}]: expected an 'input_ids' key (tokenize the examples first, "
                             f"e.g. with hybrid_pack.data.tokenize_chats)")
        ids = [doc["input_ids"] for doc in docs]
        lengths = _token_counts("input_ids", ids)
        if 0 in lengths:
            raise ValueError(f"features[{lengths.index(0)}].input_ids: expected at least one token; got an empty "
                             f"document (drop empty examples before collating)")
        num_real = sum(lengths)
        num_pad = self._num_pad_tokens(num_real)
        total = num_real + num_pad
        boundaries = PackedBoundaries.from_lengths(lengths + [num_pad] if num_pad else lengths,
                                                   num_pad_tokens=num_pad)

        input_ids = _concat("input_ids", ids, lengths, total, self.pad_token_id, torch.int64)
        if _in_every(docs, "labels"):
            labels = _concat("labels", _column(docs, "labels", lengths), lengths, total, self.separator_id,
                             torch.int64)
        else:
            labels = input_ids.clone()
            labels[num_real:] = self.separator_id
        labels.numpy()[boundaries.cu_seqlens.numpy()[:len(lengths)]] = self.separator_id

        batch: dict[str, Any] = {
            "input_ids": input_ids.view(1, total),
            "labels": labels.view(1, total),
            "position_ids": boundaries.position_ids,
            "seq_idx": boundaries.seq_idx,
            "cu_seq_lens_q": boundaries.cu_seqlens,
            "cu_seq_lens_k": boundaries.cu_seqlens,
            "max_length_q": boundaries.max_seqlen,
            "max_length_k": boundaries.max_seqlen,
        }
        for key in self.extra_token_keys:
            if _in_every(docs, key):
                values = _column(docs, key, lengths)
                batch[key] = _concat(key, values, lengths, total, 0, _extra_dtype(key, values[0])).view(1, total)
        if num_pad:
            batch["num_pad_tokens"] = num_pad
        return batch

    def _num_pad_tokens(self, num_tokens: int) -> int:
        if self.pack_length is not None:
            if num_tokens > self.pack_length:
                raise ValueError(f"pack_length: the features hold {num_tokens} tokens, more than "
                                 f"pack_length={self.pack_length} (raise pack_length, or group the examples with "
                                 f"hybrid_pack.plan_packs(lengths, capacity={self.pack_length}))")
            return self.pack_length - num_tokens
        if self.pad_to_multiple_of is not None:
            return -num_tokens % self.pad_to_multiple_of
        return 0


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_mapping(value: Any) -> bool:
    return isinstance(value, (dict, Mapping))  # dict first: the ABC check is slow


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))


def _flatten(features: Any) -> list[Feature]:
    """The documents of ``features`` in order: a list of dicts, or a list of packs (lists of dicts)."""
    if not _is_sequence(features) or _is_mapping(features):
        raise ValueError(f"features: expected a list of examples (dicts with 'input_ids') or a list of packs; got "
                         f"{type(features).__name__} (split a dict of lists into one dict per example)")
    if len(features) == 0:
        raise ValueError("features: expected at least one example; got an empty list")
    if _is_mapping(features[0]):
        for i, doc in enumerate(features):
            if not _is_mapping(doc):
                raise ValueError(f"features[{i}]: expected a dict like features[0]; got {type(doc).__name__} "
                                 f"(pass a list of examples or a list of packs, not a mix)")
        return list(features)
    docs: list[Feature] = []
    for i, pack in enumerate(features):
        if not _is_sequence(pack) or _is_mapping(pack):
            raise ValueError(f"features[{i}]: expected a pack (a list of dicts) like features[0]; "
                             f"got {type(pack).__name__}")
        if len(pack) == 0:
            raise ValueError(f"features[{i}]: expected a pack with at least one example; got an empty pack")
        for j, doc in enumerate(pack):
            if not _is_mapping(doc):
                raise ValueError(f"features[{i}][{j}]: expected a dict with 'input_ids'; got {type(doc).__name__}")
        docs.extend(pack)
    return docs


def _token_counts(key: str, values: list[Any]) -> list[int]:
    """Length of every document's ``key`` values, checking that each is one flat (1-D) sequence."""
    counts = []
    for i, value in enumerate(values):
        if isinstance(value, (list, tuple)):  # first: the common case, and isinstance on tensors costs more
            if value and isinstance(value[0], (list, tuple)):
                raise ValueError(f"features[{i}].{key}: expected a flat list (one document); got a nested list "
                                 f"(split its rows into separate examples)")
            counts.append(len(value))
        elif isinstance(value, (torch.Tensor, np.ndarray)):
            if value.ndim != 1:
                raise ValueError(f"features[{i}].{key}: expected a 1-D sequence (one document); got shape "
                                 f"{list(value.shape)} (flatten it, or split its rows into separate examples)")
            counts.append(value.shape[0])
        else:
            raise ValueError(f"features[{i}].{key}: expected a list or a 1-D tensor / array; "
                             f"got {type(value).__name__}")
    return counts


def _in_every(docs: list[Feature], key: str) -> bool:
    """Whether every document carries ``key`` (False when none does; some but not all raises)."""
    present = [key in doc for doc in docs]
    if all(present):
        return True
    if any(present):
        raise ValueError(f"features[{present.index(False)}].{key}: missing, while features[{present.index(True)}] "
                         f"has it (give '{key}' to every example or to none)")
    return False


def _column(docs: list[Feature], key: str, lengths: list[int]) -> list[Any]:
    """``doc[key]`` of every document, checked to hold one value per ``input_ids`` token."""
    values = [doc[key] for doc in docs]
    counts = _token_counts(key, values)
    if counts != lengths:
        i = next(i for i, (got, want) in enumerate(zip(counts, lengths)) if got != want)
        raise ValueError(f"features[{i}].{key}: expected {lengths[i]} values (one per input_ids token); "
                         f"got {counts[i]}")
    return values


def _extra_dtype(key: str, first: Any) -> torch.dtype:
    """float32 for :data:`FLOAT_TOKEN_KEYS` and float inputs, int64 otherwise."""
    if key in FLOAT_TOKEN_KEYS:
        return torch.float32
    if isinstance(first, (list, tuple)):
        floating = len(first) > 0 and isinstance(first[0], float)
    elif isinstance(first, torch.Tensor):
        floating = first.dtype.is_floating_point
    else:
        floating = np.issubdtype(first.dtype, np.floating)
    return torch.float32 if floating else torch.int64


def _concat(key: str, values: list[Any], lengths: list[int], total: int, fill: int, dtype: torch.dtype) -> torch.Tensor:
    """``values`` end to end in a new CPU ``dtype`` tensor ``[total]``, ``fill`` after the last value.

    All tensors: one ``torch.cat``. Otherwise lists go through :func:`struct.pack_into` (which also
    rejects floats in an integer key) and tensors / arrays are copied, document by document.
    """
    num_real = sum(lengths)
    if all(isinstance(value, torch.Tensor) for value in values):
        lossy = {have for have in {v.dtype for v in values} if not torch.can_cast(have, dtype)}
        if lossy:
            bad = next(i for i, v in enumerate(values) if v.dtype in lossy)
            raise ValueError(f"features[{bad}].{key}: expected values that cast to {dtype} without loss; got "
                             f"dtype {values[bad].dtype} (cast it first, e.g. .long() for token ids)")
        padding = [torch.full((total - num_real,), fill, dtype=dtype)] if total > num_real else []
        try:
            joined = torch.cat(values + padding)
        except RuntimeError as err:
            raise ValueError(f"features.{key}: could not concatenate the tensors ({err}); pass CPU tensors") from None
        return joined.detach().to("cpu", dtype)
    out = torch.empty(total, dtype=dtype)
    out[num_real:] = fill
    buffer = out.numpy()
    code = "f" if dtype.is_floating_point else "q"
    offset = 0
    for i, (value, n) in enumerate(zip(values, lengths)):
        if isinstance(value, (list, tuple)):
            try:
                struct.pack_into(f"{n}{code}", buffer, offset * buffer.itemsize, *value)
            except (struct.error, OverflowError) as err:
                kind = "numbers" if dtype.is_floating_point else "integers (no floats)"
                raise ValueError(f"features[{i}].{key}: expected {kind} for {dtype}; {err}") from None
        else:
            array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
            if not np.can_cast(array.dtype, buffer.dtype, casting="same_kind"):
                raise ValueError(f"features[{i}].{key}: expected values that cast to {dtype} without loss; got "
                                 f"dtype {array.dtype} (cast it first, e.g. .astype(int) for token ids)")
            buffer[offset:offset + n] = array
        offset += n
    return out
