"""Unit tests for plan_packs / PackPlan / packing_report (docs/api.md §2)."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_pack import PackPlan, plan_packs
from hybrid_pack.data import LENGTH_TABLES, load_lengths
from hybrid_pack.errors import InputError
from hybrid_pack.packing.plan import OVERFLOW_POLICIES, STRATEGIES
from hybrid_pack.packing.report import packing_report
from hybrid_pack.packing.strategies import _best_fit, _first_fit


def pack_sizes(plan: PackPlan) -> list[list[int]]:
    return [[stop - start for _, start, stop in pack] for pack in plan.packs()]


def pack_examples(plan: PackPlan) -> list[list[int]]:
    return [[example for example, _, _ in pack] for pack in plan.packs()]


# ----------------------------------------------------------------------------- strategies


def test_bfd_fills_every_pack_when_a_perfect_packing_exists():
    plan = plan_packs([5, 4, 3, 2, 2, 1, 1], 6)
    assert plan.strategy == "bfd"
    assert len(plan) == plan.lower_bound == 3
    assert plan.efficiency == 1.0
    assert plan.pack_tokens.tolist() == [6, 6, 6]


def test_bfd_puts_an_item_into_the_tightest_pack_and_ffd_into_the_first():
    # Capacity 7, sizes 5, 3, 3, 1: after 5 -> p0 and 3, 3 -> p1 the packs have 2 and 1 free.
    # The 1 goes to the tightest pack under best fit (p1) and to the first with room under first fit (p0).
    lengths = [5, 3, 3, 1]
    assert pack_examples(plan_packs(lengths, 7, strategy="bfd")) == [[0], [1, 2, 3]]
    assert pack_examples(plan_packs(lengths, 7, strategy="ffd")) == [[0, 3], [1, 2]]


def test_decreasing_strategies_break_ties_by_input_order():
    # Capacity 8, sizes 2, 6, 2, 6: the 6s open packs (example 1 first), the first 2 joins the first pack.
    for strategy in ("bfd", "ffd", "knapsack"):
        assert pack_examples(plan_packs([2, 6, 2, 6], 8, strategy=strategy))[0] == [0, 1]


def test_first_fit_keeps_input_order():
    lengths = [3, 3, 5, 1, 3, 2, 4]
    plan = plan_packs(lengths, 6, strategy="first_fit")
    packs = pack_examples(plan)
    # 3 -> p0; 3 -> p0 (full); 5 -> p1; 1 -> p1 (full); 3 -> p2; 2 -> p2; 4 -> p3
    assert packs == [[0, 1], [2, 3], [4, 5], [6]]
    for pack in packs:
        assert pack == sorted(pack)
    assert [pack[0] for pack in packs] == sorted(pack[0] for pack in packs)


def test_first_fit_goes_back_to_earlier_packs():
    # 4 -> p0 (2 free); 5 -> p1 (1 free); 2 -> p0 (the first pack with room), not p1.
    plan = plan_packs([4, 5, 2, 1], 6, strategy="first_fit")
    assert pack_examples(plan) == [[0, 2], [1, 3]]


def test_next_fit_never_reopens_a_pack():
    plan = plan_packs([4, 5, 2, 1], 6, strategy="next_fit")
    assert pack_examples(plan) == [[0], [1], [2, 3]]
    lengths = np.random.default_rng(0).integers(1, 50, 500)
    flat = [example for pack in pack_examples(plan_packs(lengths, 64, strategy="next_fit")) for example in pack]
    assert flat == list(range(500))


def test_knapsack_fills_one_pack_at_a_time_with_the_largest_that_fits():
    # Capacity 10: p0 opens with 7 (the largest) and 2 + 1 fill its last 3 exactly. p1 opens with 6;
    # nothing left fills 4 exactly, so the largest that fits goes in (2) and then nothing fits. p2 = 5.
    lengths = [2, 7, 5, 6, 2, 1]
    plan = plan_packs(lengths, 10, strategy="knapsack")
    assert pack_sizes(plan) == [[2, 7, 1], [6, 2], [5]]
    assert pack_examples(plan) == [[0, 1, 5], [3, 4], [2]]


def test_knapsack_completes_a_pack_exactly_where_greedy_ffd_does_not():
    # Capacity 10, sizes 5, 4, 3, 3, 3, 2 (20 tokens): greedy FFD takes 5, 4 (1 free) and needs 3 packs;
    # knapsack opens with 5 and finds 3 + 2 to fill the other 5, then 4 + 3 + 3.
    lengths = [3, 5, 2, 4, 3, 3]
    assert _first_fit(np.array([5, 4, 3, 3, 3, 2]), 10)[1] == 3
    plan = plan_packs(lengths, 10, strategy="knapsack")
    assert pack_examples(plan) == [[0, 1, 2], [3, 4, 5]]
    assert len(plan) == plan.lower_bound == 2


@pytest.mark.parametrize("strategy, greedy", [("bfd", _best_fit), ("ffd", _first_fit)])
def test_repair_pass_closes_the_pack_the_greedy_construction_leaves_open(strategy, greedy):
    # Same sizes: greedy BFD and FFD both end [5, 4] [3, 3, 3] [2]; the repair pass dissolves a pack
    # and refills the 1 free token of the others by swaps, reaching the lower bound of 2 full packs.
    assert greedy(np.array([5, 4, 3, 3, 3, 2]), 10)[1] == 3
    plan = plan_packs([3, 5, 2, 4, 3, 3], 10, strategy=strategy)
    assert len(plan) == plan.lower_bound == 2
    assert sorted(map(sorted, pack_sizes(plan))) == [[2, 3, 5], [3, 3, 4]]


@pytest.mark.parametrize("strategy", ["bfd", "ffd"])
@pytest.mark.parametrize("table, column", [(table, column) for table in LENGTH_TABLES
                                           for column in ("full_chatml", "last_turn_prompt", "last_turn_response")])
def test_repair_pass_reaches_the_lower_bound_on_the_bundled_lengths(table, column, strategy):
    lengths = load_lengths(table)[column]
    lengths = lengths[lengths > 0]
    plan = plan_packs(lengths, 4096, strategy=strategy, overflow="split")
    assert len(plan) == plan.lower_bound
    assert plan.pack_tokens.max() <= 4096


@pytest.mark.parametrize("strategy, greedy", [("bfd", _best_fit), ("ffd", _first_fit)])
def test_repair_pass_on_many_documents_keeps_every_invariant(strategy, greedy):
    # 100,000 GSM8K lengths: the greedy construction ends well above the bound, so the pass does real work.
    lengths = np.random.default_rng(6).choice(load_lengths("gsm8k_train")["full_chatml"], 100_000)
    plan = plan_packs(lengths, 4096, strategy=strategy)
    greedy_packs = greedy(np.sort(lengths.astype(np.int64))[::-1].copy(), 4096)[1]
    assert plan.lower_bound <= len(plan) < greedy_packs
    assert np.array_equal(np.sort(plan.example_index), np.arange(lengths.size))
    assert plan.pack_tokens.max() <= 4096 and plan.pack_num_documents.min() >= 1
    np.testing.assert_array_equal(plan.pack_tokens, np.bincount(
        np.repeat(np.arange(len(plan)), plan.pack_num_documents), weights=plan.item_lengths).astype(np.int64))
    seeded = plan_packs(lengths, 4096, strategy=strategy, seed=3)
    assert len(seeded) == len(plan)
    assert sorted(map(sorted, pack_sizes(seeded))) == sorted(map(sorted, pack_sizes(plan)))
    again = plan_packs(lengths, 4096, strategy=strategy, seed=3)
    np.testing.assert_array_equal(again.example_index, seeded.example_index)
    np.testing.assert_array_equal(again.pack_offsets, seeded.pack_offsets)


def test_knapsack_prefers_one_item_then_a_pair_then_a_triple():
    # Capacity 12 opened with 6: the other 6 fills it (not 4 + 2, not 2 + 2 + 2).
    plan = plan_packs([6, 4, 2, 2, 2, 6], 12, strategy="knapsack")
    assert pack_examples(plan) == [[0, 5], [1, 2, 3, 4]]
    # Opened with 7, 5 free, no 5 left: the pair 3 + 2 goes in, not the triple 2 + 2 + 1.
    plan = plan_packs([7, 1, 2, 2, 3], 12, strategy="knapsack")
    assert pack_sizes(plan) == [[7, 2, 3], [1, 2]]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_items_are_sorted_within_packs_and_cover_everything(strategy):
    lengths = np.random.default_rng(1).integers(1, 100, 2_000)
    plan = plan_packs(lengths, 256, strategy=strategy)
    assert sorted(plan.example_index.tolist()) == list(range(2_000))
    for pack in range(len(plan)):
        examples = plan.pack_examples(pack)
        assert np.all(np.diff(examples) > 0)
    assert plan.pack_tokens.max() <= 256
    assert plan.lower_bound <= len(plan)


# ------------------------------------------------------------------------------ overflow


def test_split_cuts_pieces_of_capacity_tokens():
    plan = plan_packs([10, 3], 4, overflow="split")
    pieces = sorted(item for pack in plan.packs() for item in pack)
    assert pieces == [(0, 0, 4), (0, 4, 8), (0, 8, 10), (1, 0, 3)]
    assert plan.num_split == 1 and plan.num_truncated == plan.num_dropped == 0
    assert plan.num_documents == 4 and plan.num_examples == 2
    assert plan.tokens_in == plan.tokens_kept == 13


def test_split_pieces_are_separate_documents_that_may_share_a_pack():
    # 6 at capacity 4 -> pieces 4 and 2; the 2 and the 2-token example share a pack.
    plan = plan_packs([6, 2], 4, overflow="split")
    assert sorted(map(sorted, plan.packs())) == [[(0, 0, 4)], [(0, 4, 6), (1, 0, 2)]]


def test_truncate_keeps_the_first_capacity_tokens():
    plan = plan_packs([10, 3, 4], 4, overflow="truncate")
    assert sorted(item for pack in plan.packs() for item in pack) == [(0, 0, 4), (1, 0, 3), (2, 0, 4)]
    assert plan.num_truncated == 1 and plan.tokens_in == 17 and plan.tokens_kept == 11


def test_drop_removes_long_examples_and_counts_them():
    plan = plan_packs([10, 3, 4, 9], 4, overflow="drop")
    assert sorted(item for pack in plan.packs() for item in pack) == [(1, 0, 3), (2, 0, 4)]
    assert plan.num_dropped == 2 and plan.tokens_kept == 7 and plan.num_examples == 4


def test_overflow_policies_change_nothing_when_everything_fits():
    lengths = [3, 1, 4, 1, 5, 2]
    plans = [plan_packs(lengths, 5, overflow=policy) for policy in OVERFLOW_POLICIES]
    for plan in plans[1:]:
        assert plan.packs() == plans[0].packs()
        assert plan.num_truncated == plan.num_split == plan.num_dropped == 0


def test_everything_dropped_gives_an_empty_plan():
    plan = plan_packs([9, 9], 4, overflow="drop")
    assert len(plan) == 0 and plan.packs() == [] and plan.efficiency == 0.0 and plan.lower_bound == 0


def test_empty_lengths_give_an_empty_plan():
    plan = plan_packs([], 8)
    assert len(plan) == 0 and plan.num_examples == 0 and plan.tokens_in == 0


# ----------------------------------------------------------------------- malformed input


@pytest.mark.parametrize("bad, index, value", [([3, 0, 2], 1, 0), ([3, 2, -4, 0], 2, -4)])
def test_non_positive_length_names_the_example(bad, index, value):
    with pytest.raises(InputError, match=rf"lengths\[{index}\]: expected a token count >= 1; got {value}.*remove"):
        plan_packs(bad, 8)


def test_too_long_example_names_the_example_and_the_fix():
    with pytest.raises(InputError, match=r"lengths\[2\]: example 2 has 9 tokens, more than capacity=8.*overflow="):
        plan_packs([1, 8, 9, 12], 8)


@pytest.mark.parametrize("bad, message", [
    ([[1, 2], [3, 4]], r"lengths: expected a 1-D sequence.*shape \[2, 2\]"),
    (5, r"lengths: expected a 1-D sequence.*got int"),
    ((n for n in [3, 4]), r"lengths: expected a 1-D sequence.*not a generator\); got generator"),
    (np.array([2**63 + 1], dtype=np.uint64), r"lengths: expected token counts below 2\*\*63"),  # wrapped negative
    ([1.5, 2.0], r"lengths: expected integer token counts; got dtype float64.*np.asarray"),
    (["3", "4"], r"lengths: expected integer token counts"),
    ([True, False], r"lengths: expected integer token counts; got dtype bool"),
    ([[1, 2], [3]], r"lengths: expected a 1-D sequence of ints"),
])
def test_malformed_lengths(bad, message):
    with pytest.raises(InputError, match=message):
        plan_packs(bad, 8)


@pytest.mark.parametrize("bad", [0, -3, 4.0, True, "4096", None])
def test_malformed_capacity(bad):
    with pytest.raises(InputError, match=r"capacity: expected an int >= 1"):
        plan_packs([1, 2], bad)


def test_unknown_strategy_lists_the_valid_ones():
    with pytest.raises(InputError, match=r"strategy: expected one of 'bfd', 'ffd', 'first_fit', 'next_fit', "
                                         r"'knapsack'; got 'best_fit'"):
        plan_packs([1, 2], 8, strategy="best_fit")


def test_unknown_overflow_lists_the_valid_ones():
    with pytest.raises(InputError, match=r"overflow: expected one of 'error', 'truncate', 'split', 'drop'; got 'wrap'"):
        plan_packs([1, 2], 8, overflow="wrap")


@pytest.mark.parametrize("bad", [-1, 1.5, "0", True])
def test_malformed_seed(bad):
    with pytest.raises(InputError, match=r"seed: expected an int >= 0"):
        plan_packs([1, 2], 8, seed=bad)


# ------------------------------------------------------------------------ seed, purity


def test_plan_is_a_pure_function_of_its_arguments():
    lengths = np.random.default_rng(2).integers(1, 300, 5_000)
    for seed in (None, 7):
        a, b = plan_packs(lengths, 512, seed=seed), plan_packs(lengths.tolist(), 512, seed=seed)
        for name in ("example_index", "start", "stop", "pack_offsets", "pack_tokens"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_seed_reorders_packs_and_ties_but_not_pack_sizes(strategy):
    lengths = np.random.default_rng(3).integers(1, 20, 3_000)  # many ties
    base = plan_packs(lengths, 64, strategy=strategy)
    shuffled = plan_packs(lengths, 64, strategy=strategy, seed=1)
    assert len(base) == len(shuffled)
    assert sorted(map(sorted, pack_sizes(base))) == sorted(map(sorted, pack_sizes(shuffled)))
    assert base.packs() != shuffled.packs()
    assert shuffled.packs() != plan_packs(lengths, 64, strategy=strategy, seed=2).packs()
    if strategy in ("first_fit", "next_fit"):
        assert sorted(base.packs()) == sorted(shuffled.packs())


def test_seed_none_returns_packs_in_opening_order():
    plan = plan_packs([9, 1, 8, 2, 7, 3], 10, strategy="bfd")
    assert pack_examples(plan) == [[0, 1], [2, 3], [4, 5]]


# ---------------------------------------------------------------------------- accessors


def test_array_accessors_agree_with_packs():
    lengths = np.random.default_rng(4).integers(1, 700, 3_000)
    plan = plan_packs(lengths, 512, overflow="split", seed=5)
    packs = plan.packs()
    assert len(packs) == len(plan) == plan.pack_offsets.size - 1
    for i in (0, 17, len(plan) - 1, -1):
        examples, starts, stops = plan.pack_items(i)
        assert list(zip(examples.tolist(), starts.tolist(), stops.tolist(), strict=True)) == packs[i]
        assert plan.pack_examples(i).tolist() == [item[0] for item in packs[i]]
        assert plan.pack_tokens[i] == sum(stop - start for _, start, stop in packs[i])
        assert plan.pack_num_documents[i] == len(packs[i])
    assert plan.item_lengths.sum() == plan.tokens_kept == plan.pack_tokens.sum()
    for name in ("example_index", "start", "stop", "pack_offsets", "pack_tokens"):
        array = getattr(plan, name)
        assert array.dtype == np.int64 and not array.flags.writeable
    with pytest.raises(IndexError, match="pack: expected an index"):
        plan.pack_items(len(plan))


def test_repr_is_short():
    plan = plan_packs(np.full(100_000, 3), 64)
    assert len(repr(plan)) < 250 and "packs=4762" in repr(plan)


# ------------------------------------------------------------------------------- report


def test_report_counts_padding_of_each_layout():
    plan = plan_packs([4, 2, 3, 1, 6], 8)
    report = packing_report(plan, batch_size=2)
    assert (report.tokens, report.packs, report.lower_bound, report.gap) == (16, 2, 2, 0)
    assert report.packed_padding == 0 and report.efficiency == 1.0
    # batches [4, 2] -> 2 pad, [3, 1] -> 2 pad, [6] -> 0 pad
    assert report.padded_batch_padding == 4
    assert report.padded_to_capacity_padding == 5 * 8 - 16
    assert report.padded_batch_efficiency == pytest.approx(16 / 20)
    as_dict = report.to_dict()
    assert as_dict["padded_batch_padding"] == 4 and as_dict["gap_fraction"] == 0.0
    text = str(report)
    assert "packed (bfd)" in text and "padded batches of 2" in text and "padded to capacity" in text


def test_report_uses_documents_in_example_order():
    plan = plan_packs([1, 9, 1, 9], 10, strategy="bfd", seed=3)
    # example order: [1, 9] -> pad 8, [1, 9] -> pad 8, whatever order the packs came in
    assert packing_report(plan, batch_size=2).padded_batch_padding == 16


def test_report_of_split_plan_counts_pieces():
    report = packing_report(plan_packs([10, 3], 4, overflow="split"), batch_size=4)
    assert report.documents == 4 and report.examples == 2
    assert report.padded_batch_padding == 4 * 4 - 13


@pytest.mark.parametrize("bad", [0, 2.0, True])
def test_report_rejects_bad_batch_size(bad):
    with pytest.raises(InputError, match="batch_size: expected an int >= 1"):
        packing_report(plan_packs([1, 2], 4), batch_size=bad)


# ------------------------------------------------------------------ max_documents (static batches)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_max_documents_bounds_every_pack_and_keeps_every_token(strategy):
    lengths = np.random.default_rng(3).integers(1, 40, 300)
    plan = plan_packs(lengths, 128, strategy=strategy, max_documents=4, seed=1)
    unlimited = plan_packs(lengths, 128, strategy=strategy, seed=1)
    assert plan.pack_num_documents.max() <= 4 < unlimited.pack_num_documents.max()
    assert plan.pack_tokens.max() <= 128 and plan.tokens_kept == lengths.sum()
    assert sorted(plan.example_index.tolist()) == list(range(lengths.size))
    assert plan.max_documents == 4


def test_max_documents_must_be_positive():
    with pytest.raises(InputError, match="max_documents"):
        plan_packs([1, 2], 8, max_documents=0)


def test_a_capacity_far_above_the_documents_costs_no_memory():
    """The strategies index by free space: capacity 2**31 - 1 for two short documents allocated about 40 GB."""
    import tracemalloc

    plan_packs([3, 5], 16)  # the strategies' compilation, outside the measure
    tracemalloc.start()
    try:
        plan = plan_packs([3, 5], 10**8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert plan.packs() == [[(0, 0, 3), (1, 0, 5)]] and plan.capacity == 10**8
    assert peak < 10 * 2**20, peak  # 1.9 GB before
