"""Packing an unbounded stream of examples with a bounded buffer.

:func:`pack_stream` reads examples from any iterable (a Hugging Face ``IterableDataset``, a
generator, a list) and yields packs (lists of example dicts) of at most ``capacity`` tokens, holding
at most ``buffer_size`` examples at any time:

1. Examples are read into the buffer. One of exactly ``capacity`` tokens is a full pack and goes
   out at once; one longer than ``capacity`` is handled by ``overflow`` on arrival (``"split"``
   sends its full pieces out at once and buffers only the remainder).
2. When the buffer is full, its examples are planned with :func:`~hybrid_pack.plan_packs`, and the
   fullest packs are yielded until at most ``buffer_size // 2`` examples remain. The examples of
   the emptiest packs stay, to be planned again with the next examples, which fill them up.
3. At the end of the stream everything left is planned and yielded.

The output is a pure function of the input order and the arguments. :attr:`PackStream.report`
keeps running counts (efficiency, truncation, buffer high-water mark) while the stream is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from hybrid_pack.errors import InputError
from hybrid_pack.packing.plan import OVERFLOW_POLICIES, STRATEGIES, plan_packs
from hybrid_pack.packing.slicing import slice_example
from hybrid_pack.schema import INPUT_IDS

__all__ = ["PackStream", "StreamReport", "pack_stream"]

Example = Mapping[str, Any]


@dataclass
class StreamReport:
    """Running counts of one pass over a :class:`PackStream`.

    Attributes:
        capacity: tokens per pack.
        examples_in, tokens_in: examples and tokens read from the source so far.
        packs, documents, tokens_out: packs yielded, documents (examples or pieces) and real tokens in them.
        num_truncated, tokens_truncated: examples cut to ``capacity`` and the tokens cut off.
        num_split: examples cut into pieces. num_dropped, tokens_dropped: examples left out.
        buffered: examples held right now; max_buffered: the most ever held (<= buffer_size).
    """

    capacity: int
    examples_in: int = 0
    tokens_in: int = 0
    packs: int = 0
    documents: int = 0
    tokens_out: int = 0
    num_truncated: int = 0
    tokens_truncated: int = 0
    num_split: int = 0
    num_dropped: int = 0
    tokens_dropped: int = 0
    buffered: int = 0
    max_buffered: int = 0

    @property
    def efficiency(self) -> float:
        """Real tokens over token slots of the packs yielded so far (0.0 before the first)."""
        return self.tokens_out / (self.packs * self.capacity) if self.packs else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {**self.__dict__, "efficiency": self.efficiency}


class PackStream(IterableDataset):
    """Iterable of packs over a stream of examples; build with :func:`pack_stream`.

    Each iteration re-reads ``source`` (a generator can therefore be read once) and resets
    :attr:`report`. As a ``torch.utils.data.IterableDataset`` it feeds
    ``DataLoader(stream, batch_size=None, collate_fn=PackingCollator())`` directly (one worker at
    most: shard the source per worker or rank before packing).
    """

    def __init__(self, source: Iterable[Example], capacity: int, *, buffer_size: int, strategy: str,
                 overflow: str, length_key: str) -> None:
        self.source = source
        self.capacity = capacity
        self.buffer_size = buffer_size
        self.strategy = strategy
        self.overflow = overflow
        self.length_key = length_key
        self.report = StreamReport(capacity)

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        worker = get_worker_info()
        if worker is not None and worker.num_workers > 1:
            raise InputError(f"num_workers: a PackStream reads its source once per worker, so {worker.num_workers} "
                             f"workers would repeat every example; use num_workers <= 1 or shard the source first")
        report = self.report = StreamReport(self.capacity)
        buffer: list[Example] = []
        lengths: list[int] = []
        for position, example in enumerate(self.source):
            length = self._length(position, example)
            report.examples_in += 1
            report.tokens_in += length
            for piece, piece_length in self._fit(position, example, length):
                if piece_length == self.capacity:
                    yield self._emit([piece], piece_length)
                else:
                    buffer.append(piece)
                    lengths.append(piece_length)
            report.buffered = len(buffer)
            report.max_buffered = max(report.max_buffered, len(buffer))
            if len(buffer) == self.buffer_size:
                yield from self._drain(buffer, lengths, keep=self.buffer_size // 2)
        yield from self._drain(buffer, lengths, keep=0)

    def _length(self, position: int, example: Example) -> int:
        if not isinstance(example, Mapping) or self.length_key not in example:
            got = f"keys {sorted(example)}" if isinstance(example, Mapping) else type(example).__name__
            raise InputError(f"source[{position}]: expected a dict with a {self.length_key!r} sequence; got {got}")
        tokens = example[self.length_key]
        nested = isinstance(tokens, (list, tuple)) and len(tokens) > 0 and isinstance(tokens[0], (list, tuple))
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__") or getattr(tokens, "ndim", 1) != 1 \
                or nested:  # a [1, T] row would count as one token
            got = type(tokens).__name__ if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__") \
                else f"shape {list(np.shape(tokens))}"
            raise InputError(f"source[{position}].{self.length_key}: expected a flat sequence (one entry per token); "
                             f"got {got}")
        length = len(tokens)
        if length == 0:
            raise InputError(f"source[{position}].{self.length_key}: expected at least one token; got an empty "
                             f"sequence (filter empty examples out of the stream)")
        return length

    def _fit(self, position: int, example: Example, length: int) -> Iterator[tuple[Example, int]]:
        """The documents an example becomes under ``overflow``, with their lengths."""
        capacity, report = self.capacity, self.report
        if length <= capacity:
            yield example, length
            return
        if self.overflow == "error":
            raise InputError(f"source[{position}]: example has {length} tokens, more than capacity={capacity}; "
                             f"pass overflow='truncate', 'split' or 'drop', or raise capacity")
        if self.overflow == "drop":
            report.num_dropped += 1
            report.tokens_dropped += length
        elif self.overflow == "truncate":
            report.num_truncated += 1
            report.tokens_truncated += length - capacity
            yield slice_example(example, 0, capacity, length_key=self.length_key), capacity
        else:
            report.num_split += 1
            for start in range(0, length, capacity):
                stop = min(start + capacity, length)
                yield slice_example(example, start, stop, length_key=self.length_key), stop - start

    def _emit(self, pack: list[Example], tokens: int) -> list[Example]:
        self.report.packs += 1
        self.report.documents += len(pack)
        self.report.tokens_out += tokens
        return pack

    def _drain(self, buffer: list[Example], lengths: list[int], *, keep: int) -> Iterator[list[Example]]:
        """Plan the buffer, yield its fullest packs until at most ``keep`` examples remain, keep the rest."""
        if not buffer:
            return
        plan = plan_packs(np.asarray(lengths, dtype=np.int64), self.capacity, strategy=self.strategy)
        fullest_first = np.argsort(-plan.pack_tokens, kind="stable")
        remaining = len(buffer)
        emitted = np.zeros(len(buffer), dtype=bool)
        packs = []
        for p in fullest_first:
            if remaining <= keep:
                break
            items = plan.pack_examples(int(p))
            emitted[items] = True
            remaining -= items.shape[0]
            packs.append(([buffer[i] for i in items.tolist()], int(plan.pack_tokens[p])))
        kept = np.flatnonzero(~emitted).tolist()
        buffer[:] = [buffer[i] for i in kept]
        lengths[:] = [lengths[i] for i in kept]
        self.report.buffered = len(buffer)
        for pack, tokens in packs:
            yield self._emit(pack, tokens)


def pack_stream(
    source: Iterable[Example],
    capacity: int,
    *,
    buffer_size: int = 10_000,
    strategy: str = "bfd",
    overflow: str = "truncate",
    length_key: str = INPUT_IDS,
) -> PackStream:
    """Pack a stream of tokenized examples into packs of at most ``capacity`` tokens.

    Args:
        source: iterable of example dicts (e.g. a ``datasets.IterableDataset`` after tokenization, or
            a generator); each has a per-token sequence under ``length_key``.
        capacity: tokens per pack.
        buffer_size: the most examples held at once (>= 1). Larger buffers pack tighter.
        strategy: any :func:`~hybrid_pack.plan_packs` strategy, used on each buffer.
        overflow: for an example longer than ``capacity``: ``"truncate"`` (default: keep its first
            ``capacity`` tokens), ``"split"`` (pieces of ``capacity`` tokens, the last shorter; every
            per-token field is cut alike), ``"drop"`` or ``"error"``.
        length_key: the key whose length is the example's token count.

    Returns:
        A :class:`PackStream`: iterate it for packs (lists of example dicts, in buffer order inside a
        pack); ``stream.report`` holds the running :class:`StreamReport`.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
        raise InputError(f"capacity: expected an int >= 1; got {capacity!r}")
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) or buffer_size < 1:
        raise InputError(f"buffer_size: expected an int >= 1; got {buffer_size!r}")
    if strategy not in STRATEGIES:
        raise InputError(f"strategy: expected one of {', '.join(map(repr, STRATEGIES))}; got {strategy!r}")
    if overflow not in OVERFLOW_POLICIES:
        raise InputError(f"overflow: expected one of {', '.join(map(repr, OVERFLOW_POLICIES))}; got {overflow!r}")
    if not isinstance(source, Iterable):
        raise InputError(f"source: expected an iterable of example dicts; got {type(source).__name__}")
    return PackStream(source, int(capacity), buffer_size=int(buffer_size), strategy=strategy, overflow=overflow,
                      length_key=length_key)
