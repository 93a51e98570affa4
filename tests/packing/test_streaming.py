"""pack_stream: deterministic, bounded buffer, every example (every kept token) exactly once."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from hybrid_pack import PackingCollator, plan_packs
from hybrid_pack.errors import InputError
from hybrid_pack.packing import pack_stream


def _examples(lengths):
    return [{"id": i, "input_ids": list(range(n)), "labels": [i] * n, "text": "t" * n} for i, n in enumerate(lengths)]


class CountingSource:
    """A re-iterable source that records, at every pull, how many examples are held by the stream."""

    def __init__(self, examples, emitted_tokens: Counter, kept_length) -> None:
        self.examples = examples
        self.emitted_tokens = emitted_tokens
        self.kept_length = kept_length
        self.held_at_pull: list[int] = []

    def __iter__(self):
        for pulled, example in enumerate(self.examples, start=1):
            done = sum(1 for e in self.examples[:pulled - 1]
                       if self.emitted_tokens[e["id"]] == self.kept_length(len(e["input_ids"])))
            self.held_at_pull.append(pulled - done)
            yield example


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 250), max_size=120), buffer_size=st.integers(1, 40),
       capacity=st.integers(40, 200), overflow=st.sampled_from(["truncate", "split", "drop"]),
       strategy=st.sampled_from(["bfd", "ffd", "first_fit", "next_fit", "knapsack"]))
def test_bounded_buffer_and_every_kept_token_once(lengths, buffer_size, capacity, overflow, strategy):
    def kept_length(n):
        if overflow in ("split", "truncate"):
            return n if overflow == "split" else min(n, capacity)
        return n if n <= capacity else 0

    emitted = Counter()
    source = CountingSource(_examples(lengths), emitted, kept_length)
    stream = pack_stream(source, capacity, buffer_size=buffer_size, overflow=overflow, strategy=strategy)
    spans: dict[int, list[tuple[int, int]]] = {}
    num_packs = 0
    for pack in stream:
        num_packs += 1
        assert 0 < sum(len(d["input_ids"]) for d in pack) <= capacity
        for doc in pack:
            n = len(doc["input_ids"])
            assert doc["labels"] == [doc["id"]] * n and doc["text"] == "t" * lengths[doc["id"]]
            spans.setdefault(doc["id"], []).append((doc["input_ids"][0], doc["input_ids"][-1] + 1))
            emitted[doc["id"]] += n
        assert stream.report.max_buffered <= buffer_size

    assert max(source.held_at_pull, default=0) <= buffer_size
    expected = {i: kept_length(n) for i, n in enumerate(lengths) if kept_length(n)}
    assert sorted(spans) == sorted(expected)
    for i, pieces in spans.items():
        pieces.sort()
        assert pieces[0][0] == 0 and pieces[-1][1] == expected[i]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))

    report = stream.report
    too_long = sum(n > capacity for n in lengths)
    assert report.examples_in == len(lengths) and report.tokens_in == sum(lengths)
    assert report.packs == num_packs and report.tokens_out == sum(expected.values())
    assert report.num_truncated == (too_long if overflow == "truncate" else 0)
    assert report.num_split == (too_long if overflow == "split" else 0)
    assert report.num_dropped == (too_long if overflow == "drop" else 0)
    assert report.tokens_in == report.tokens_out + report.tokens_truncated + report.tokens_dropped
    assert report.buffered == 0


def test_deterministic_across_passes_and_generators():
    lengths = np.random.default_rng(0).integers(1, 700, 3000).tolist()
    examples = _examples(lengths)
    stream = pack_stream(examples, 1024, buffer_size=256)
    first = [[d["id"] for d in pack] for pack in stream]
    assert first == [[d["id"] for d in pack] for pack in stream]
    assert first == [[d["id"] for d in pack] for pack in pack_stream((e for e in examples), 1024, buffer_size=256)]


def test_whole_stream_in_the_buffer_matches_the_offline_plan():
    lengths = np.random.default_rng(1).integers(1, 900, 2000)
    stream = pack_stream(_examples(lengths), 2048, buffer_size=len(lengths) + 1)
    packs = list(stream)
    plan = plan_packs(lengths, 2048)
    assert len(packs) == len(plan)
    assert stream.report.efficiency == pytest.approx(plan.efficiency)


def test_small_buffer_still_packs_tightly():
    lengths = np.random.default_rng(2).integers(1, 1500, 20_000)
    stream = pack_stream(({"input_ids": range(n)} for n in lengths), 4096, buffer_size=1000)
    for _ in stream:
        pass
    assert stream.report.efficiency > 0.99


def test_hugging_face_iterable_dataset_and_dataloader():
    datasets = pytest.importorskip("datasets")
    lengths = np.random.default_rng(3).integers(1, 100, 300).tolist()
    iterable = datasets.Dataset.from_list(_examples(lengths)).select_columns(["input_ids", "labels"])
    iterable = iterable.to_iterable_dataset()
    stream = pack_stream(iterable, 256, buffer_size=64)
    loader = DataLoader(stream, batch_size=None, collate_fn=PackingCollator())
    total = 0
    for batch in loader:
        assert batch["input_ids"].shape[1] <= 256
        assert torch.equal(batch["cu_seq_lens_q"], batch["cu_seq_lens_k"])
        total += batch["input_ids"].shape[1]
    assert total == sum(lengths)


def test_full_length_examples_pass_straight_through():
    stream = pack_stream(_examples([64, 10, 64, 20]), 64, buffer_size=2)
    assert [[d["id"] for d in pack] for pack in stream] == [[0], [2], [1, 3]]


def test_errors_name_the_field():
    with pytest.raises(InputError, match="buffer_size"):
        pack_stream([], 64, buffer_size=0)
    with pytest.raises(InputError, match="capacity"):
        pack_stream([], 0)
    with pytest.raises(InputError, match="strategy"):
        pack_stream([], 64, strategy="best")
    with pytest.raises(InputError, match="overflow"):
        pack_stream([], 64, overflow="wrap")
    with pytest.raises(InputError, match=r"source\[1\]"):
        list(pack_stream([{"input_ids": [1]}, {"text": "no ids"}], 64))
    with pytest.raises(InputError, match=r"source\[0\].*capacity"):
        list(pack_stream([{"input_ids": [1] * 100}], 64, overflow="error"))
    with pytest.raises(InputError, match="at least one token"):
        list(pack_stream([{"input_ids": []}], 64))
    # a [1, T] row counted as one token: over-capacity packs, a report that did not add up
    for ids, got in ((torch.arange(20)[None], r"shape \[1, 20\]"), ([[1, 2]], r"shape \[1, 2\]"), (5, "int")):
        with pytest.raises(InputError, match=rf"source\[0\]\.input_ids: expected a flat sequence .* got {got}"):
            list(pack_stream([{"input_ids": ids}], 8, overflow="truncate"))
