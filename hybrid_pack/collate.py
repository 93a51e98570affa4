"""PackingCollator: tokenized examples -> one packed row ``[1, T]`` with its document boundaries.

The output holds the keys Hugging Face models take for padding-free training (``input_ids``,
``labels``, restarting ``position_ids``, ``seq_idx``, ``cu_seq_lens_q/k``, ``max_length_q/k``),
so ``model(**collator(features))`` works. The cost is a few calls per key and per batch, plus the
copy itself; nothing loops over tokens in Python:

- tensors: one ``torch.cat`` per key; NumPy arrays: one ``np.concatenate`` into the output buffer;
- Python lists: :func:`struct.pack_into` per document into the output buffer, or one ``bytes``
  join when every value fits a byte (masks), the fastest readers of Python ints and floats
  measured (``benchmarks/bench_collator.py``);
- checks run once per key over all documents (one comprehension each), not per document;
- the boundary keys come from :meth:`PackedBoundaries.from_lengths` (one compiled pass).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.host import StaticHostBoundaries
from hybrid_pack.boundaries.static import StaticBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.multimodal import MULTIMODAL_KEYS, PositionIdsFn, pack_vision_inputs
from hybrid_pack.schema import (
    ATTENTION_MASK,
    COLLATED_KEYS,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    DEFAULT_EXTRA_TOKEN_KEYS,
    FLOAT_TOKEN_KEYS,
    HOST_BOUNDARIES,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    NUM_PAD_TOKENS,
    POSITION_IDS,
    SEQ_IDX,
    PackedBatch,
)

__all__ = ["PackingCollator"]

_LIST_TYPES = frozenset({list, tuple})
_RETURN_TENSORS = ("pt", "np")
_MAX_TOKENS = np.iinfo(np.int32).max
_NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32}

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
        max_documents: with ``pack_length``, the static form (docs/api.md §9, docs/compile.md): every batch has the
            same shapes and Python values, for one compiled graph: ``cu_seq_lens_q/k`` int32
            ``[max_documents + 2]`` (unused slots repeat ``pack_length``), ``max_length_q/k`` =
            ``pack_length``, ``num_pad_tokens`` an int64 0-d tensor. More documents raise ``InputError``.
        return_tensors: ``"pt"`` (torch tensors) or ``"np"`` (NumPy arrays, same dtypes and shapes; the
            Python ints stay ints). Also a ``__call__`` argument, for that call only.
        return_position_ids: False leaves ``position_ids`` out; the other boundary keys still say where
            every document starts (``PackedBoundaries.from_batch``, ``HybridForCausalLM`` and patched
            models rebuild the positions). Refused with ``max_documents``: a compiled forward reads them.
        return_flash_attn_kwargs, return_seq_idx: accepted so that this class replaces transformers'
            ``DataCollatorWithFlattening`` unchanged; True here (its default is False) and must stay True:
            False raises ``InputError``, since a hybrid model needs ``cu_seq_lens_q/k``, ``max_length_q/k``
            and ``seq_idx`` to keep the documents apart.
        position_ids_start: 0, the only value taken: positions restart at 0 in every document, as the
            boundaries and RoPE read them (an offset is for RoBERTa-style absolute position embeddings).
        position_ids_fn: how the model numbers one sample's positions, for models whose positions are not
            ``0..L-1`` (M-RoPE): ``fn(input_ids [1, L] int64, mm_token_type_ids [1, L] int64 | None,
            image_grid_thw [n, 3] int64 | None, video_grid_thw [m, 3] int64 | None) -> int64 [3, 1, L]``, e.g.
            ``hybrid_pack.mrope.mrope_position_ids(model)``. ``position_ids`` is then
            int64 ``[3, 1, T]``: every document's own positions, as the model computes them for it alone, and
            ``0..pad-1`` on every row for the padding. None: the restarting 1-D positions, right for text and for
            vision-language models with 1-D positions, wrong for an M-RoPE model given images. It must pickle
            (DataLoader workers).

    Multimodal samples (docs/api.md §3b), as a processor returns them one sample at a time: ``input_ids`` with
    the image / video placeholder tokens, ``mm_token_type_ids`` ``[L]`` (0 text, 1 image, 2 video),
    ``pixel_values`` ``[P, C]`` with ``image_grid_thw`` ``[n, 3]``, ``pixel_values_videos`` with
    ``video_grid_thw``; any of them absent (or None) in a text-only sample. The batch then also holds
    ``mm_token_type_ids`` int64 ``[1, T]`` (0 for samples without it and for padding), the pixels concatenated
    in document order (dtype kept) and the grids int64 ``[sum n, 3]`` stacked in the same order; a key no sample
    carries is absent. Each sample is checked (pixel rows equal ``sum(t * h * w)`` of its grid, pixels and grid
    together, ``mm_token_type_ids`` present and matching the grids, one image-token run per image):
    :class:`~hybrid_pack.errors.InputError` names the sample and the key. In the static form the row length, the
    document count and every Python value stay fixed, but the pixel tensors and grids change rows with the
    images of each batch.

    ``__call__(features, return_tensors=None, separator_id=None)`` (the last two override the
    constructor's for that call) returns, for ``T`` tokens (padding included) in ``S`` segments
    (the documents, plus the padding segment if any):

    - ``input_ids``, ``labels``, ``position_ids``: int64 ``[1, T]``;
    - ``seq_idx``: int32 ``[1, T]``; ``cu_seq_lens_q`` and ``cu_seq_lens_k``: int32 ``[S + 1]``
      (one tensor under both names);
    - ``max_length_q``, ``max_length_k``: Python int, the longest segment;
    - every extra key present: float32 or int64 ``[1, T]``;
    - ``num_pad_tokens``: Python int, only when padding was added;
    - ``host_boundaries``: a :class:`~hybrid_pack.boundaries.host.HostBoundaries`, the segment lengths as Python
      ints (no tensor, no ``.to``: ``transformers.Trainer``, accelerate and TRL pass it to the model untouched), so
      that the model builds its boundaries without reading a tensor (docs/api.md §9b). It holds only for the
      tensors it came with: drop it from a batch whose tokens or boundary keys you cut or edit. In the static
      form (``max_documents``) a :class:`~hybrid_pack.boundaries.host.StaticHostBoundaries` instead: the same
      values as CPU tensors of fixed shapes (a compiled graph specialises on Python ints, not on tensor values).

    With ``return_flash_attn_kwargs=True, return_seq_idx=True`` transformers' ``DataCollatorWithFlattening``
    gives the same keys (``host_boundaries`` aside), values, dtypes and types for the same features, ``"pt"`` or
    ``"np"`` (``tests/test_collate_hf.py``). Where it is lenient this class refuses, as documented below and in
    docs/collator.md: a key it does not take (transformers drops it), an empty example (dropped there),
    ``labels`` in some examples only (read from the first example there), a negative token id (or an unsigned
    one above ``2**63 - 1``, which wraps to a negative int64; copied there).

    Any other feature key raises :class:`~hybrid_pack.errors.InputError` naming it (nothing is dropped
    silently), except an ``attention_mask`` of all ones, which is checked and dropped (the boundaries
    replace it; a mask with zeros means padded examples, and raises). Tensors come out on the CPU.
    """

    def __init__(
        self,
        *,
        separator_id: int = IGNORE_INDEX,
        pad_to_multiple_of: int | None = None,
        pack_length: int | None = None,
        pad_token_id: int = 0,
        extra_token_keys: Sequence[str] = DEFAULT_EXTRA_TOKEN_KEYS,
        max_documents: int | None = None,
        return_tensors: Literal["pt", "np"] = "pt",
        return_position_ids: bool = True,
        return_flash_attn_kwargs: bool = True,
        return_seq_idx: bool = True,
        position_ids_start: int = 0,
        position_ids_fn: PositionIdsFn | None = None,
    ) -> None:
        for name, value in (("pad_to_multiple_of", pad_to_multiple_of), ("pack_length", pack_length)):
            if value is not None and (not _is_int(value) or value < 1):
                raise InputError(f"{name}: expected a positive int or None; got {value!r}")
        if max_documents is not None and (not _is_int(max_documents) or max_documents < 1 or pack_length is None):
            raise InputError(f"max_documents: expected a positive int together with pack_length (the static form "
                             f"fixes both); got max_documents={max_documents!r}, pack_length={pack_length!r}")
        if pad_to_multiple_of is not None and pack_length is not None and pack_length % pad_to_multiple_of:
            raise InputError(f"pack_length: expected a multiple of pad_to_multiple_of={pad_to_multiple_of}; got "
                             f"{pack_length} (pass only one of them, or make pack_length a multiple)")
        for name, value in (("separator_id", separator_id), ("pad_token_id", pad_token_id)):
            if not _is_int(value):
                raise InputError(f"{name}: expected an int; got {value!r}")
        if isinstance(extra_token_keys, str):
            raise InputError(f"extra_token_keys: expected a sequence of key names; got the string "
                             f"{extra_token_keys!r} (wrap it: ({extra_token_keys!r},))")
        clashes = sorted(set(extra_token_keys) & (COLLATED_KEYS | MULTIMODAL_KEYS))
        if clashes:
            raise InputError(f"extra_token_keys: {clashes} are built by the collator itself; remove them")
        self.separator_id = int(separator_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pack_length = pack_length
        self.pad_token_id = int(pad_token_id)
        self.extra_token_keys = tuple(extra_token_keys)
        self.max_documents = max_documents
        self.return_tensors = return_tensors
        self.return_position_ids = return_position_ids
        self.return_flash_attn_kwargs = return_flash_attn_kwargs
        self.return_seq_idx = return_seq_idx
        self.position_ids_start = position_ids_start
        if position_ids_fn is not None and not callable(position_ids_fn):
            raise InputError(f"position_ids_fn: expected a callable or None; got {position_ids_fn!r}")
        self.position_ids_fn = position_ids_fn
        self._check_flattening_settings()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(separator_id={self.separator_id}, "
                f"pad_to_multiple_of={self.pad_to_multiple_of}, pack_length={self.pack_length}, "
                f"pad_token_id={self.pad_token_id}, extra_token_keys={self.extra_token_keys}, "
                f"max_documents={self.max_documents}, return_tensors={self.return_tensors!r}, "
                f"return_position_ids={self.return_position_ids}, position_ids_fn={self.position_ids_fn!r})")

    def __call__(self, features: Sequence[Feature] | Sequence[Sequence[Feature]],
                 return_tensors: Literal["pt", "np"] | None = None, separator_id: int | None = None) -> PackedBatch:
        self._check_flattening_settings()  # the attributes are public: checked again, as transformers reads them
        return_tensors = self.return_tensors if return_tensors is None else _checked_return_tensors(return_tensors)
        if separator_id is None:
            separator_id = self.separator_id
        elif not _is_int(separator_id):
            raise InputError(f"separator_id: expected an int; got {separator_id!r}")
        separator_id = int(separator_id)
        docs = _flatten(features)
        try:
            ids = [doc[INPUT_IDS] for doc in docs]
        except KeyError:
            index = next(i for i, doc in enumerate(docs) if INPUT_IDS not in doc)
            raise InputError(f"features[{index}]: expected an {INPUT_IDS!r} key (tokenize the examples first, "
                             f"e.g. with hybrid_pack.data.tokenize_chats)") from None
        ids_kind = _kind(ids)
        lengths = _token_counts(INPUT_IDS, ids, ids_kind)
        if 0 in lengths:
            raise InputError(f"features[{lengths.index(0)}].{INPUT_IDS}: expected at least one token; got an empty "
                             f"document (drop empty examples before collating)")
        num_real = sum(lengths)
        num_pad = self._num_pad_tokens(num_real)
        layout = _Layout(lengths, num_real, num_real + num_pad)
        if layout.total > _MAX_TOKENS:
            raise InputError(f"features: expected fewer than 2**31 tokens per batch (cu_seq_lens is int32); got "
                             f"{layout.total} (split the batch)")
        self._check_other_keys(docs, layout)
        boundaries = PackedBoundaries.from_document_lengths(lengths, num_pad_tokens=num_pad)

        input_ids = _concat(INPUT_IDS, ids, ids_kind, layout, self.pad_token_id, torch.int64)
        _refuse_negative_ids(input_ids.numpy()[0, :num_real], boundaries)
        column = _column(docs, LABELS, layout)
        if column is None:
            labels = input_ids.clone()
            labels.numpy()[0, num_real:] = separator_id
        else:
            labels = _concat(LABELS, *column, layout, separator_id, torch.int64)
        labels.numpy()[0, boundaries.cu_seqlens.numpy()[:len(lengths)]] = separator_id
        batch: dict[str, Any] = {INPUT_IDS: input_ids, LABELS: labels, **boundaries.hf_kwargs(),
                                 HOST_BOUNDARIES: boundaries.host()}
        for key in self.extra_token_keys:
            column = _column(docs, key, layout)
            if column is not None:
                values, kind = column
                batch[key] = _concat(key, values, kind, layout, 0, _extra_dtype(key, values[0]))
        if self.position_ids_fn is not None or any(not MULTIMODAL_KEYS.isdisjoint(doc) for doc in docs):
            batch.update(pack_vision_inputs(docs, lengths, num_pad, input_ids, self.position_ids_fn))
        if num_pad:
            batch[NUM_PAD_TOKENS] = num_pad
        if self.max_documents is not None:  # a compiled graph reads shapes only: host tensors, not ints (§9)
            cu_seqlens = StaticBoundaries.from_boundaries(boundaries, self.max_documents).cu_seqlens
            batch.update({CU_SEQ_LENS_Q: cu_seqlens, CU_SEQ_LENS_K: cu_seqlens, MAX_LENGTH_Q: self.pack_length,
                          MAX_LENGTH_K: self.pack_length, NUM_PAD_TOKENS: torch.tensor(num_pad),
                          HOST_BOUNDARIES: StaticHostBoundaries(cu_seqlens.clone(), torch.tensor(num_pad))})
        if not self.return_position_ids:
            del batch[POSITION_IDS]
        if return_tensors == "np":  # CPU tensors: .numpy() shares the buffer, no copy
            batch = {key: value.numpy() if isinstance(value, torch.Tensor) else value for key, value in batch.items()}
        return batch  # type: ignore[return-value]

    def _check_flattening_settings(self) -> None:
        """Refuse the ``DataCollatorWithFlattening`` settings that would drop or shift the boundaries."""
        _checked_return_tensors(self.return_tensors)
        flags = (("return_flash_attn_kwargs", (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K)),
                 ("return_seq_idx", (SEQ_IDX,)))
        for name, keys in flags:
            value = getattr(self, name)
            if not (isinstance(value, (bool, np.bool_)) and value):
                raise InputError(f"{name}: expected True; got {value!r}. A hybrid model needs {', '.join(keys)} to "
                                 f"keep the packed documents apart: attention, convolutions and recurrent states "
                                 f"must restart at every document, or they run across the boundaries. "
                                 f"PackingCollator always returns {', '.join(keys)}: remove {name}={value!r}")
        if not isinstance(self.return_position_ids, (bool, np.bool_)):
            raise InputError(f"return_position_ids: expected True or False; got {self.return_position_ids!r}")
        if not self.return_position_ids and self.max_documents is not None:
            raise InputError(f"return_position_ids: expected True with max_documents={self.max_documents} (the "
                             f"static form): a compiled packed forward reads {CU_SEQ_LENS_Q}, {SEQ_IDX} and "
                             f"{POSITION_IDS} (StaticBoundaries.from_batch); drop return_position_ids=False")
        if not _is_int(self.position_ids_start) or self.position_ids_start != 0:
            raise InputError(f"position_ids_start: expected 0; got {self.position_ids_start!r}. {POSITION_IDS} "
                             f"restart at 0 in every document: PackedBoundaries.from_batch reads them so, and "
                             f"HybridForCausalLM and patched models take RoPE positions from the boundaries (an "
                             f"offset is for RoBERTa-style absolute position embeddings); remove the argument")

    def _check_other_keys(self, docs: list[Feature], layout: _Layout) -> None:
        """Refuse a key this collator would not emit; accept (and drop) an ``attention_mask`` of all ones."""
        known = {INPUT_IDS, LABELS, ATTENTION_MASK, *self.extra_token_keys, *MULTIMODAL_KEYS}
        unknown = set().union(*docs) - known
        if unknown:
            key = min(unknown, key=str)
            index = next(i for i, doc in enumerate(docs) if key in doc)
            raise InputError(f"features[{index}].{key}: not a key this collator takes (input_ids, labels, "
                             f"attention_mask, {', '.join(sorted(MULTIMODAL_KEYS))}, "
                             f"extra_token_keys={self.extra_token_keys}); add it to "
                             f"extra_token_keys to concatenate it per token, or remove it from the examples")
        column = None if ATTENTION_MASK in self.extra_token_keys else _column(docs, ATTENTION_MASK, layout)
        if column is not None:
            mask = _concat(ATTENTION_MASK, *column, _Layout(layout.lengths, layout.num_real, layout.num_real), 1,
                           torch.int64)[0].numpy()
            if not (mask == 1).all():
                index = int(np.searchsorted(np.cumsum(layout.lengths), np.argmax(mask != 1), side="right"))
                raise InputError(f"features[{index}].{ATTENTION_MASK}: expected all ones (a packed row needs no mask); "
                                 f"got zeros: pass the examples unpadded, without their padding tokens")

    def _num_pad_tokens(self, num_tokens: int) -> int:
        if self.pack_length is not None:
            if num_tokens > self.pack_length:
                raise InputError(f"pack_length: the features hold {num_tokens} tokens, more than "
                                 f"pack_length={self.pack_length} (raise pack_length, or group the examples with "
                                 f"hybrid_pack.plan_packs(lengths, capacity={self.pack_length}))")
            return self.pack_length - num_tokens
        if self.pad_to_multiple_of is not None:
            return -num_tokens % self.pad_to_multiple_of
        return 0


def _checked_return_tensors(value: Any) -> str:
    if not isinstance(value, str) or value not in _RETURN_TENSORS:
        raise InputError(f"return_tensors: expected 'pt' (torch tensors) or 'np' (NumPy arrays); got {value!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_mapping(value: Any) -> bool:
    return isinstance(value, (dict, Mapping))  # dict first: the ABC check is slow


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))


def _flatten(features: Any) -> list[Feature]:
    """The documents of ``features`` in order: a list of dicts, or a list of packs (lists of dicts)."""
    if not _is_sequence(features) or _is_mapping(features):
        raise InputError(f"features: expected a list of examples (dicts with 'input_ids') or a list of packs; got "
                         f"{type(features).__name__} (split a dict of lists into one dict per example)")
    if len(features) == 0:
        raise InputError("features: expected at least one example; got an empty list")
    if _is_mapping(features[0]):
        if {type(doc) for doc in features} != {dict}:
            for i, doc in enumerate(features):
                if not _is_mapping(doc):
                    raise InputError(f"features[{i}]: expected a dict like features[0]; got {type(doc).__name__} "
                                     f"(pass a list of examples or a list of packs, not a mix)")
        return list(features)
    docs: list[Feature] = []
    for i, pack in enumerate(features):
        if not _is_sequence(pack) or _is_mapping(pack):
            raise InputError(f"features[{i}]: expected a pack (a list of dicts) like features[0]; "
                             f"got {type(pack).__name__}")
        if len(pack) == 0:
            raise InputError(f"features[{i}]: expected a pack with at least one example; got an empty pack")
        for j, doc in enumerate(pack):
            if not _is_mapping(doc):
                raise InputError(f"features[{i}][{j}]: expected a dict with 'input_ids'; got {type(doc).__name__}")
        docs.extend(pack)
    return docs


class _Layout:
    """Where documents go in the packed row: ``lengths`` tokens each, ``num_real`` in all, ``total``
    with padding; ``shapes`` are the 1-D shapes every per-token key must have."""

    __slots__ = ("lengths", "num_real", "shapes", "total")

    def __init__(self, lengths: list[int], num_real: int, total: int) -> None:
        self.lengths = lengths
        self.num_real = num_real
        self.total = total
        self.shapes = [(n,) for n in lengths]


_Kind = Literal["lists", "tensors", "arrays", "mixed"]


def _kind(values: list[Any]) -> _Kind:
    """How a key's values are given: all lists / tuples, all tensors, all arrays, or anything else."""
    types = {type(value) for value in values}
    if types <= _LIST_TYPES:
        return "lists"
    if types == {torch.Tensor}:
        return "tensors"
    if types == {np.ndarray}:
        return "arrays"
    return "mixed"


def _token_counts(key: str, values: list[Any], kind: _Kind) -> list[int]:
    """Length of every document's ``key`` values, checking that each is one flat (1-D) sequence."""
    if kind == "lists":
        if not any(value and isinstance(value[0], (list, tuple)) for value in values):
            return [len(value) for value in values]
    elif kind == "tensors" or kind == "arrays":
        shapes = [value.shape for value in values]
        if all(len(shape) == 1 for shape in shapes):
            return [shape[0] for shape in shapes]
    else:
        for i, value in enumerate(values):
            if not isinstance(value, (list, tuple, torch.Tensor, np.ndarray)):
                raise InputError(f"features[{i}].{key}: expected a list or a 1-D tensor / array; "
                                 f"got {type(value).__name__}")
    for i, value in enumerate(values):
        if isinstance(value, (list, tuple)):
            if value and isinstance(value[0], (list, tuple)):
                raise InputError(f"features[{i}].{key}: expected a flat list (one document); got a nested list "
                                 f"(split its rows into separate examples)")
        elif value.ndim != 1:
            raise InputError(f"features[{i}].{key}: expected a 1-D sequence (one document); got shape "
                             f"{list(value.shape)} (flatten it, or split its rows into separate examples)")
    return [len(value) for value in values]


def _column(docs: list[Feature], key: str, layout: _Layout) -> tuple[list[Any], _Kind] | None:
    """``doc[key]`` of every document and how they are given, checked to hold one value per
    ``input_ids`` token; None when no document has ``key`` (some but not all raises)."""
    try:
        values = [doc[key] for doc in docs]
    except KeyError:
        present = [key in doc for doc in docs]
        if any(present):
            raise InputError(f"features[{present.index(False)}].{key}: missing, while "
                             f"features[{present.index(True)}] has it (give '{key}' to every example or to none)"
                             ) from None
        return None
    kind = _kind(values)
    if kind in ("tensors", "arrays") and [value.shape for value in values] == layout.shapes:
        return values, kind
    counts = _token_counts(key, values, kind)
    if counts != layout.lengths:
        i = next(i for i, (got, want) in enumerate(zip(counts, layout.lengths)) if got != want)
        raise InputError(f"features[{i}].{key}: expected {layout.lengths[i]} values (one per input_ids token); "
                         f"got {counts[i]}")
    return values, kind


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


def _refuse_negative_ids(ids: np.ndarray, boundaries: PackedBoundaries) -> None:
    """Raise InputError naming the first document with a negative token id (an unsigned id above ``2**63 - 1``
    wraps to one in int64): it indexes no embedding row, and on a GPU fails as a device-side assert."""
    if ids.size and ids.min() < 0:
        at = int(np.argmax(ids < 0))
        doc = int(np.searchsorted(boundaries.cu_seqlens.numpy(), at, side="right")) - 1
        raise InputError(f"features[{doc}].{INPUT_IDS}: expected token ids >= 0; got {int(ids[at])} at token "
                         f"{at - int(boundaries.cu_seqlens[doc])} (unsigned ids above 2**63 - 1 wrap to negative "
                         "int64; ids come from the tokenizer, labels may use -100)")


def _concat(key: str, values: list[Any], kind: _Kind, layout: _Layout, fill: int, dtype: torch.dtype) -> torch.Tensor:
    """``values`` end to end in a new CPU ``dtype`` tensor ``[1, layout.total]``, ``fill`` on the padding."""
    if kind == "tensors":
        return _cat_tensors(key, values, layout, fill, dtype)
    out = np.empty((1, layout.total), dtype=_NUMPY_DTYPES[dtype])
    row = out[0]
    row[layout.num_real:] = fill
    if kind == "arrays":
        _cat_arrays(key, values, row[:layout.num_real])
    elif kind == "lists":
        _pack_lists(key, values, row)
    else:
        offset = 0
        for i, (value, n) in enumerate(zip(values, layout.lengths)):
            part = row[offset:offset + n]
            if isinstance(value, (list, tuple)):
                _pack_lists(key, [value], part, first_index=i)
            else:
                array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
                _cat_arrays(key, [array], part, first_index=i)
            offset += n
    return torch.from_numpy(out)


def _cat_tensors(key: str, values: list[torch.Tensor], layout: _Layout, fill: int, dtype: torch.dtype) -> torch.Tensor:
    """1-D tensors end to end, then ``fill`` up to ``layout.total``, as a new CPU ``dtype`` tensor ``[1, total]``.

    ``torch.cat`` promotes mixed dtypes; a dtype that does not cast to ``dtype`` without loss
    (floats into int64) is refused.
    """
    if layout.total > layout.num_real:
        values = [*values, torch.full((layout.total - layout.num_real,), fill, dtype=dtype)]
    try:
        joined = torch.cat(values)
    except RuntimeError as err:
        raise InputError(f"features.{key}: could not concatenate the tensors ({err}); pass CPU tensors") from None
    if joined.requires_grad:
        joined = joined.detach()
    if joined.dtype != dtype or not joined.is_cpu:
        if not torch.can_cast(joined.dtype, dtype):  # the promoted dtype is lossy only if an input's is
            i = next(i for i, value in enumerate(values) if not torch.can_cast(value.dtype, dtype))
            raise InputError(f"features[{i}].{key}: expected values that cast to {dtype} without loss; got "
                             f"dtype {values[i].dtype} (cast it first, e.g. .long() for token ids)")
        joined = joined.to("cpu", dtype)
    return joined[None]


def _cat_arrays(key: str, values: list[np.ndarray], out: np.ndarray, *, first_index: int = 0) -> None:
    """Copy 1-D arrays end to end into ``out``; refuse a dtype that does not cast to ``out``'s without loss."""
    try:
        np.concatenate(values, out=out, casting="same_kind")
    except TypeError:
        i = next(i for i, value in enumerate(values) if not np.can_cast(value.dtype, out.dtype, casting="same_kind"))
        raise InputError(f"features[{first_index + i}].{key}: expected values that cast to {out.dtype} without "
                         f"loss; got dtype {values[i].dtype} (cast it first, e.g. .astype(int) for token ids)"
                         ) from None


def _pack_lists(key: str, values: list[Sequence[Any]], out: np.ndarray, *, first_index: int = 0) -> None:
    """Write lists of Python numbers end to end at the start of ``out`` (int64 or float32).

    Integers that all fit a byte (masks) go through one ``bytes`` join, about twice as fast;
    anything else through :func:`struct.pack_into`, which also rejects floats in an integer key.
    """
    if out.dtype == np.int64:
        try:
            joined = b"".join(map(bytes, values))
        except (ValueError, TypeError):  # a value outside 0..255, or not an int: struct below
            pass
        else:
            out[:len(joined)] = np.frombuffer(joined, dtype=np.uint8)
            return
    code, dtype = ("q", torch.int64) if out.dtype == np.int64 else ("f", torch.float32)
    offset = 0
    for i, value in enumerate(values):
        try:
            _packer(len(value), code).pack_into(out, offset * out.itemsize, *value)
        except (struct.error, OverflowError) as err:
            kind = "integers (no floats)" if code == "q" else "numbers"
            raise InputError(f"features[{first_index + i}].{key}: expected {kind} for {dtype}; {err}") from None
        offset += len(value)


@functools.lru_cache(maxsize=4096)
def _packer(length: int, code: str) -> struct.Struct:
    """Compiled format for ``length`` values of ``code``; :mod:`struct`'s own cache holds only 100."""
    return struct.Struct(f"{length}{code}")
