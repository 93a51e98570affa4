"""Offline packing plans: which examples (or pieces of examples) go into which packed row.

:func:`plan_packs` turns per-example token counts into a :class:`PackPlan`. The plan stores flat
numpy arrays (CSR style: items pack after pack, plus pack offsets), so planning millions of
examples builds no Python object per example; :meth:`PackPlan.packs` materialises lists on demand.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hybrid_pack.errors import InputError
from hybrid_pack.packing.strategies import ORDER_KEEPING, STRATEGIES, assign_bins, group_by_bin

__all__ = ["OVERFLOW_POLICIES", "STRATEGIES", "PackPlan", "check_plan_settings", "plan_packs"]

OVERFLOW_POLICIES = ("error", "truncate", "split", "drop")
"""What to do with an example longer than ``capacity``, default first."""


@dataclass(frozen=True, eq=False, repr=False)
class PackPlan:
    """An assignment of documents to packs of at most ``capacity`` tokens. Build with :func:`plan_packs`.

    A *document* (an *item*) is the token slice ``[start, stop)`` of one example: the whole example,
    its first ``capacity`` tokens (``overflow="truncate"``) or one piece of it (``overflow="split"``).
    Items are stored pack after pack; pack ``p`` holds items ``pack_offsets[p]:pack_offsets[p + 1]``,
    in ascending (example, start) order. All arrays are read-only.

    Attributes:
        example_index: int64 ``[M]``, the example each item comes from.
        start: int64 ``[M]``, first token of the item within its example.
        stop: int64 ``[M]``, one past the last token of the item.
        pack_offsets: int64 ``[P+1]``, CSR offsets of the packs into the item arrays.
        pack_tokens: int64 ``[P]``, real tokens in each pack (``<= capacity``).
        capacity, strategy, overflow, seed: the arguments the plan was made with.
        num_examples: examples given (``len(lengths)``).
        tokens_in: tokens of all examples given.
        tokens_kept: tokens placed in packs (``tokens_in`` minus truncated and dropped tokens).
        num_truncated, num_split, num_dropped: examples longer than ``capacity`` that were
            truncated, split or dropped (only the one matching ``overflow`` can be non-zero).
        max_documents: the most documents any pack may hold (None: no limit).

    Cheap per-pack access for samplers: :meth:`pack_items` / :meth:`pack_examples` return views,
    :attr:`pack_tokens` the token count of every pack, :attr:`pack_num_documents` the item count.
    """

    example_index: np.ndarray
    start: np.ndarray
    stop: np.ndarray
    pack_offsets: np.ndarray
    pack_tokens: np.ndarray
    capacity: int
    strategy: str
    overflow: str
    seed: int | None
    num_examples: int
    tokens_in: int
    tokens_kept: int
    num_truncated: int
    num_split: int
    num_dropped: int
    max_documents: int | None = None

    def __post_init__(self) -> None:
        for array in (self.example_index, self.start, self.stop, self.pack_offsets, self.pack_tokens):
            array.flags.writeable = False

    def __len__(self) -> int:
        """Number of packs ``P``."""
        return self.pack_offsets.shape[0] - 1

    @property
    def num_documents(self) -> int:
        """Number of items ``M`` (examples kept, counting every piece of a split example)."""
        return self.example_index.shape[0]

    @property
    def item_lengths(self) -> np.ndarray:
        """int64 ``[M]``, tokens of each item (``stop - start``), pack after pack."""
        return self.stop - self.start

    @property
    def pack_num_documents(self) -> np.ndarray:
        """int64 ``[P]``, items in each pack."""
        return np.diff(self.pack_offsets)

    @property
    def efficiency(self) -> float:
        """Real tokens over token slots, ``tokens_kept / (len(plan) * capacity)``; 0.0 for an empty plan."""
        return self.tokens_kept / (len(self) * self.capacity) if len(self) else 0.0

    @property
    def lower_bound(self) -> int:
        """``ceil(tokens_kept / capacity)``: no plan of these documents has fewer packs."""
        return -(-self.tokens_kept // self.capacity)

    def _pack_slice(self, pack: int) -> slice:
        num_packs = len(self)
        pack = operator.index(pack)
        if not -num_packs <= pack < num_packs:
            raise IndexError(f"pack: expected an index in [{-num_packs}, {num_packs}); got {pack}")
        pack %= num_packs
        return slice(int(self.pack_offsets[pack]), int(self.pack_offsets[pack + 1]))

    def pack_items(self, pack: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(example_index, start, stop)`` of one pack: three int64 ``[n]`` read-only views, no copy."""
        items = self._pack_slice(pack)
        return self.example_index[items], self.start[items], self.stop[items]

    def pack_examples(self, pack: int) -> np.ndarray:
        """int64 ``[n]`` view: the example index of every item of one pack."""
        return self.example_index[self._pack_slice(pack)]

    def packs(self) -> list[list[tuple[int, int, int]]]:
        """Every pack as a list of ``(example_index, start, stop)`` Python tuples (builds M tuples)."""
        examples, starts, stops = self.example_index.tolist(), self.start.tolist(), self.stop.tolist()
        return [list(zip(examples[a:b], starts[a:b], stops[a:b], strict=True))
                for a, b in itertools.pairwise(self.pack_offsets.tolist())]

    def __repr__(self) -> str:
        return (f"PackPlan(packs={len(self)}, documents={self.num_documents}, examples={self.num_examples}, "
                f"capacity={self.capacity}, strategy={self.strategy!r}, overflow={self.overflow!r}, "
                f"efficiency={self.efficiency:.4f}, lower_bound={self.lower_bound})")


def _check_int(field: str, value: Any, *, minimum: int) -> int:
    """``value`` as an int, refused unless it is an int (not a bool) ``>= minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InputError(f"{field}: expected an int >= {minimum}; got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise InputError(f"{field}: expected an int >= {minimum}; got {value}")
    return int(value)


def check_plan_settings(capacity: Any, strategy: str, overflow: str, seed: Any) -> tuple[int, int | None]:
    """``(capacity, seed)`` as ints, after checking every setting of :func:`plan_packs` but the lengths."""
    capacity = _check_int("capacity", capacity, minimum=1)
    if strategy not in STRATEGIES:
        raise InputError(f"strategy: expected one of {', '.join(map(repr, STRATEGIES))}; got {strategy!r}")
    if overflow not in OVERFLOW_POLICIES:
        raise InputError(f"overflow: expected one of {', '.join(map(repr, OVERFLOW_POLICIES))}; got {overflow!r}")
    return capacity, None if seed is None else _check_int("seed", seed, minimum=0)


def _check_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """int64 ``[N]`` copy of ``lengths``, each >= 1."""
    try:
        array = np.asarray(lengths)
    except (TypeError, ValueError) as err:
        raise InputError(f"lengths: expected a 1-D sequence of ints; could not read it as an array ({err})") from None
    if array.ndim != 1:
        got = type(lengths).__name__ if array.ndim == 0 else f"shape {list(array.shape)}"
        raise InputError(f"lengths: expected a 1-D sequence of ints (one token count per example; a list or array, "
                         f"not a generator); got {got}")
    if array.size and array.dtype.kind == "u" and array.max() > np.iinfo(np.int64).max:
        raise InputError(f"lengths: expected token counts below 2**63; got {int(array.max())}")
    if array.size and (array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer)):
        raise InputError(f"lengths: expected integer token counts; got dtype {array.dtype} "
                         f"(convert with np.asarray(lengths, dtype=np.int64))")
    array = array.astype(np.int64)
    bad = np.flatnonzero(array < 1)
    if bad.size:
        i = int(bad[0])
        raise InputError(f"lengths[{i}]: expected a token count >= 1; got {int(array[i])} "
                         f"({bad.size} example(s) affected; remove empty examples before planning)")
    return array


def _documents(lengths: np.ndarray, capacity: int, overflow: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(example_index, start, stop)`` int64 ``[M]`` of every document to pack, in example order."""
    too_long = lengths > capacity
    if overflow == "error" and too_long.any():
        i = int(np.argmax(too_long))
        raise InputError(f"lengths[{i}]: example {i} has {int(lengths[i])} tokens, more than capacity={capacity} "
                         f"({int(too_long.sum())} example(s) affected); pass overflow='truncate', 'split' or "
                         f"'drop', or raise capacity")
    if overflow == "split":
        pieces = -(-lengths // capacity)
        example_index = np.repeat(np.arange(lengths.size, dtype=np.int64), pieces)
        first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
        start = (np.arange(example_index.size, dtype=np.int64) - first_piece) * capacity
        return example_index, start, np.minimum(start + capacity, lengths[example_index])
    example_index = np.flatnonzero(~too_long) if overflow == "drop" else np.arange(lengths.size, dtype=np.int64)
    stop = np.minimum(lengths[example_index], capacity)
    return example_index.astype(np.int64), np.zeros_like(stop), stop


def _assign_packs(sizes: np.ndarray, capacity: int, strategy: str,
                  rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    """Documents grouped pack after pack: ``(items, pack_offsets)`` as :func:`group_by_bin` returns them.

    With ``rng``, a size-sorting strategy takes equal sizes in a random order, and the packs come
    out in a random order (two permutations drawn in this order); without, in input and opening order.
    """
    if rng is None or strategy in ORDER_KEEPING:
        order = np.arange(sizes.size, dtype=np.int64)
    else:
        order = rng.permutation(sizes.size).astype(np.int64)
    # the strategies index by free space (memory O(capacity)): beyond the total, every document fits one pack anyway
    bin_of_item, num_packs = assign_bins(sizes, min(capacity, max(int(sizes.sum()), 1)), strategy, order)
    pack_rank = (np.arange(num_packs, dtype=np.int64) if rng is None
                 else rng.permutation(num_packs).astype(np.int64))
    return group_by_bin(bin_of_item, pack_rank)


def _limit_documents(items: np.ndarray, sizes: np.ndarray, pack_offsets: np.ndarray,
                     max_documents: int) -> tuple[np.ndarray, np.ndarray]:
    """``(items, pack_offsets)`` with every pack of more than ``max_documents`` items cut into packs of at most
    ``max_documents``, its items taken longest first (ties by item: which pieces share a pack then depends on the
    pack's lengths only, never on the seed)."""
    pack_of = np.repeat(np.arange(pack_offsets.size - 1), np.diff(pack_offsets))
    items = items[np.lexsort((items, -sizes[items], pack_of))]
    counts = np.diff(pack_offsets)
    pieces = -(-counts // max_documents)
    first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
    starts = np.repeat(pack_offsets[:-1], pieces) + max_documents * (np.arange(pieces.sum()) - first_piece)
    return items, np.append(starts, pack_offsets[-1]).astype(np.int64)


def _pack_tokens(item_lengths: np.ndarray, pack_offsets: np.ndarray) -> np.ndarray:
    """int64 ``[P]``, tokens in each pack, from the lengths of the items stored pack after pack."""
    token_offsets = np.zeros(item_lengths.size + 1, np.int64)
    np.cumsum(item_lengths, out=token_offsets[1:])
    return np.diff(token_offsets[pack_offsets])


def _overflow_counts(lengths: np.ndarray, capacity: int, overflow: str) -> dict[str, int]:
    """The :class:`PackPlan` counts of examples over ``capacity``: all under ``overflow``'s name, 0 elsewhere."""
    num_over = int((lengths > capacity).sum())
    return {"num_truncated": num_over if overflow == "truncate" else 0,
            "num_split": num_over if overflow == "split" else 0,
            "num_dropped": num_over if overflow == "drop" else 0}


def plan_packs(
    lengths: Sequence[int] | np.ndarray,
    capacity: int,
    *,
    strategy: str = "bfd",
    overflow: str = "error",
    seed: int | None = None,
    max_documents: int | None = None,
) -> PackPlan:
    """Plan packs of at most ``capacity`` tokens from per-example token counts.

    Args:
        lengths: int ``[N]`` (sequence or 1-D array), token count of each example, each >= 1.
        capacity: tokens per pack, >= 1.
        strategy: ``"bfd"`` (best-fit decreasing + a gap-closing repair pass), ``"ffd"``
            (first-fit decreasing + the same pass; the pass only ever removes packs),
            ``"first_fit"`` (input order kept as far as possible), ``"next_fit"`` (input order,
            one open pack) or ``"knapsack"`` (one pack at a time: the longest remaining document,
            then the longest that fits, or up to three that fill the pack exactly). See
            ``docs/packing.md``.
        overflow: for an example longer than ``capacity``: ``"error"`` (raise), ``"truncate"`` (keep
            its first ``capacity`` tokens), ``"split"`` (cut it into pieces of ``capacity`` tokens,
            the last one shorter, each piece its own document) or ``"drop"``.
        seed: ``None`` keeps the order the strategy produces: packs in the order they were opened,
            equal lengths taken in input order. An int shuffles the order packs are returned in and,
            for the size-sorting strategies (bfd, ffd, knapsack), which of several equal-length
            documents is placed first, using ``numpy.random.default_rng(seed)``. ``first_fit`` and
            ``next_fit`` still consider documents in input order. A seed never changes the number
            of packs or the multiset of document lengths in each pack.
        max_documents: no pack holds more documents than this (the static batches of
            ``PackingCollator(pack_length=capacity, max_documents=...)``, docs/compile.md): a pack the
            strategy filled with more is cut into several, its documents taken longest first.

    Returns:
        A :class:`PackPlan`; every kept token of every example appears in exactly one pack, and the
        plan is a pure function of the arguments.

    Raises:
        InputError: (a ``ValueError``) malformed ``lengths`` / ``capacity`` / ``seed``, unknown
            ``strategy`` or ``overflow``, or (``overflow="error"``) an example longer than ``capacity``.
    """
    capacity, seed = check_plan_settings(capacity, strategy, overflow, seed)
    lengths = _check_lengths(lengths)
    example_index, start, stop = _documents(lengths, capacity, overflow)
    rng = np.random.default_rng(seed) if seed is not None else None
    items, pack_offsets = _assign_packs(stop - start, capacity, strategy, rng)
    if max_documents is not None:
        items, pack_offsets = _limit_documents(items, stop - start, pack_offsets,
                                               _check_int("max_documents", max_documents, minimum=1))
    example_index, start, stop = example_index[items], start[items], stop[items]
    pack_tokens = _pack_tokens(stop - start, pack_offsets)
    return PackPlan(
        example_index=example_index,
        start=start,
        stop=stop,
        pack_offsets=pack_offsets,
        pack_tokens=pack_tokens,
        capacity=capacity,
        strategy=strategy,
        overflow=overflow,
        seed=seed,
        num_examples=int(lengths.size),
        tokens_in=int(lengths.sum()),
        tokens_kept=int(pack_tokens.sum()),
        **_overflow_counts(lengths, capacity, overflow),
        max_documents=max_documents,
    )
