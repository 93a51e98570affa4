"""PackedBatchSampler: exactly-once coverage, equal steps, balance, determinism and exact resumption."""

from __future__ import annotations

import itertools
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from hybrid_pack import PackingCollator
from hybrid_pack.errors import InputError
from hybrid_pack.packing import PackedBatchSampler
from hybrid_pack.packing.balance import TokenCost, assign_packs
from hybrid_pack.packing.slicing import SlicedDataset

LENGTHS_DIR = Path(__file__).resolve().parents[2] / "hybrid_pack" / "data" / "assets" / "lengths"
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _all_ranks(lengths, capacity, num_replicas, epoch=0, **kwargs) -> list[list[list]]:
    batches = []
    for rank in range(num_replicas):
        sampler = PackedBatchSampler(lengths, capacity, num_replicas=num_replicas, rank=rank, **kwargs)
        sampler.set_epoch(epoch)
        batches.append(list(sampler))
    return batches


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kwargs)


def _repeated_items(sampler: PackedBatchSampler) -> Counter:
    """Items of the packs repeated to fill the last step (only when documents < packs needed)."""
    repeats = range(sampler.num_packs - sampler.num_repeated_packs, sampler.num_packs)
    assert sampler.num_repeated_packs == 0 or sampler.plan.num_documents < sampler.num_packs
    return Counter(item for pack in repeats for item in sampler.pack_items(pack))


lengths_st = st.lists(st.integers(1, 96), min_size=1, max_size=150)


@SETTINGS
@given(lengths=lengths_st, num_replicas=st.integers(1, 8), packs_per_step=st.integers(1, 3),
       capacity=st.integers(96, 300), seed=st.integers(0, 2**16), epoch=st.integers(0, 5))
def test_every_example_once_across_ranks_and_equal_steps(lengths, num_replicas, packs_per_step, capacity, seed, epoch):
    per_rank = _quiet(_all_ranks, lengths, capacity, num_replicas, epoch, seed=seed, packs_per_step=packs_per_step)
    reference = _quiet(PackedBatchSampler, lengths, capacity, num_replicas=num_replicas, packs_per_step=packs_per_step,
                       seed=seed)
    assert len({len(batches) for batches in per_rank}) == 1
    assert all(len(batches) == len(reference) for batches in per_rank)
    for batches in per_rank:
        for batch in batches:
            assert 0 < sum(lengths[i] for i in batch) <= packs_per_step * capacity
    seen = Counter(i for batches in per_rank for batch in batches for i in batch)
    assert seen - _repeated_items(reference) == Counter(range(len(lengths)))


@SETTINGS
@given(lengths=lengths_st, num_replicas=st.integers(1, 8), packs_per_step=st.integers(1, 3),
       seed=st.integers(0, 2**16), epoch=st.integers(0, 3), data=st.data())
def test_resume_from_any_step_reproduces_the_rest_of_the_epoch(lengths, num_replicas, packs_per_step, seed, epoch,
                                                               data):
    kwargs = {"num_replicas": num_replicas, "packs_per_step": packs_per_step, "seed": seed}
    rank = data.draw(st.integers(0, num_replicas - 1))
    sampler = _quiet(PackedBatchSampler, lengths, 128, rank=rank, **kwargs)
    sampler.set_epoch(epoch)
    full = list(sampler)
    stop = data.draw(st.integers(0, len(full)))
    interrupted = _quiet(PackedBatchSampler, lengths, 128, rank=rank, **kwargs)
    interrupted.set_epoch(epoch)
    iterator = iter(interrupted)
    head = [next(iterator) for _ in range(stop)]
    state = interrupted.state_dict()
    assert state["epoch"] == epoch and state["step"] == stop

    resumed = _quiet(PackedBatchSampler, lengths, 128, rank=rank, **kwargs)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)
    assert head + list(resumed) == full
    assert list(resumed) == full


@SETTINGS
@given(lengths=st.lists(st.integers(1, 400), min_size=1, max_size=80), num_replicas=st.integers(1, 4),
       overflow=st.sampled_from(["truncate", "split"]))
def test_truncate_and_split_yield_slices_covering_kept_tokens_once(lengths, num_replicas, overflow):
    capacity = 100
    per_rank = _quiet(_all_ranks, lengths, capacity, num_replicas, overflow=overflow)
    reference = _quiet(PackedBatchSampler, lengths, capacity, num_replicas=num_replicas, overflow=overflow)
    yielded = Counter(item for batches in per_rank for batch in batches for item in batch)
    covered: dict[int, list[tuple[int, int]]] = {}
    for index, start, stop in (yielded - _repeated_items(reference)).elements():
        covered.setdefault(index, []).append((start, stop))
    for batches in per_rank:
        for batch in batches:
            assert sum(stop - start for _, start, stop in batch) <= capacity
    assert sorted(covered) == list(range(len(lengths)))
    for index, spans in covered.items():
        spans.sort()
        kept = min(lengths[index], capacity) if overflow == "truncate" else lengths[index]
        assert spans[0][0] == 0 and spans[-1][1] == kept
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_order_is_a_pure_function_of_seed_and_epoch():
    lengths = np.random.default_rng(0).integers(1, 500, 400)
    a = _all_ranks(lengths, 1024, 4, epoch=2, seed=7)
    assert a == _all_ranks(lengths, 1024, 4, epoch=2, seed=7)
    assert a != _all_ranks(lengths, 1024, 4, epoch=3, seed=7)
    assert a != _all_ranks(lengths, 1024, 4, epoch=2, seed=8)
    unshuffled = _all_ranks(lengths, 1024, 4, epoch=0, shuffle=False)
    assert unshuffled == _all_ranks(lengths, 1024, 4, epoch=5, shuffle=False)


def test_steps_of_all_ranks_interleaved_match_each_rank():
    lengths = np.random.default_rng(1).integers(1, 300, 300)
    per_rank = _all_ranks(lengths, 512, 3, epoch=1, packs_per_step=2)
    interleaved = PackedBatchSampler(lengths, 512, num_replicas=3, rank=None, packs_per_step=2)
    interleaved.set_epoch(1)
    batches = list(interleaved)
    assert len(batches) == len(interleaved) == 3 * len(per_rank[0])
    for rank in range(3):
        assert batches[rank::3] == per_rank[rank]


def test_interleaved_sampler_under_accelerate_batch_sampler_shard():
    """accelerate's BatchSamplerShard (what Trainer / accelerator.prepare wrap a sampler in) gives rank r its steps."""
    accelerate_data_loader = pytest.importorskip("accelerate.data_loader")
    lengths = np.random.default_rng(2).integers(1, 300, 500)
    per_rank = _all_ranks(lengths, 512, 4)
    for rank in range(4):
        shard = accelerate_data_loader.BatchSamplerShard(
            PackedBatchSampler(lengths, 512, num_replicas=4, rank=None), num_processes=4, process_index=rank)
        assert len(shard) == len(per_rank[rank])
        assert list(shard) == per_rank[rank]


@pytest.mark.parametrize("name,capacity,overflow", [("gsm8k_train", 4096, "error"),
                                                    ("arena_hard_v2_sky_t1_32b", 8192, "split")])
@pytest.mark.parametrize("packs_per_step", [1, 2])
def test_rank_cost_within_two_percent_of_mean_on_8_ranks(name, capacity, overflow, packs_per_step):
    lengths = np.load(LENGTHS_DIR / f"{name}.qwen3_lengths.npz")["full_chatml"]
    lengths = np.random.default_rng(0).choice(lengths, 20_000)
    sampler = PackedBatchSampler(lengths, capacity, num_replicas=8, overflow=overflow, packs_per_step=packs_per_step)
    for epoch in (0, 1):
        stats = sampler.balance(epoch)
        assert stats.epoch_max_over_mean <= 1.02
        assert stats.step_max_over_mean <= 1.02


def test_assign_packs_balances_costs_better_than_round_robin():
    costs = TokenCost()(np.random.default_rng(3).integers(100, 8192, 800))
    layout = assign_packs(costs, 8, 1)
    assert sorted(layout.ravel().tolist()) == list(range(800))
    totals = costs[layout].sum(axis=(0, 2))
    round_robin = costs.reshape(-1, 8).sum(axis=0)
    assert totals.max() / totals.mean() < 1.001 < round_robin.max() / round_robin.mean()


def test_pack_count_is_made_a_multiple_by_splitting_not_dropping():
    lengths = [10] * 25
    sampler = PackedBatchSampler(lengths, 100, num_replicas=4)
    assert len(sampler.plan) == 3 and sampler.num_packs == 4 and sampler.num_repeated_packs == 0
    assert sorted(i for r in _all_ranks(lengths, 100, 4) for b in r for i in b) == list(range(25))


def test_too_few_documents_repeat_the_cheapest_packs_with_a_warning():
    with pytest.warns(UserWarning, match="repeated"):
        sampler = PackedBatchSampler([5, 3, 2], 8, num_replicas=4)
    assert sampler.num_repeated_packs == 1 and len(sampler) == 1
    per_rank = _quiet(_all_ranks, [5, 3, 2], 8, 4)
    assert sorted(i for r in per_rank for b in r for i in b) == [0, 1, 2, 2]


@pytest.mark.parametrize("packs_per_step", [1, 3])
def test_dataloader_with_the_real_collator(packs_per_step):
    rng = np.random.default_rng(4)
    dataset = [{"input_ids": rng.integers(0, 100, n).tolist()} for n in rng.integers(1, 60, 90)]
    lengths = [len(d["input_ids"]) for d in dataset]
    sampler = PackedBatchSampler(lengths, 128, num_replicas=2, rank=1, packs_per_step=packs_per_step)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=PackingCollator())
    assert len(loader) == len(sampler)
    layout = sampler.layout()
    for step, batch in enumerate(loader):
        packs = [[dataset[i] for i in sampler.pack_items(p)] for p in layout[step, 1]]
        expected = PackingCollator()(packs)
        assert batch["input_ids"].shape[1] <= packs_per_step * 128
        for key in ("input_ids", "labels", "position_ids", "seq_idx", "cu_seq_lens_q"):
            assert torch.equal(batch[key], expected[key])


def test_sliced_dataset_feeds_split_pieces_to_the_collator():
    dataset = [{"input_ids": list(range(n)), "labels": list(range(n))} for n in (250, 40, 90)]
    sampler = PackedBatchSampler([250, 40, 90], 100, overflow="split")
    loader = DataLoader(SlicedDataset(dataset), batch_sampler=sampler, collate_fn=PackingCollator())
    tokens = sorted(t for batch in loader for t in batch["input_ids"][0].tolist())
    assert tokens == sorted([*range(250), *range(40), *range(90)])
    assert all(batch["input_ids"].shape[1] <= 100 for batch in loader)


@pytest.mark.parametrize("kind", ["list", "hf"])
def test_token_slices_on_a_dataset_indexed_by_example_say_to_wrap_it(kind):
    """A split plan's items on a plain list or a Hugging Face Dataset raised the dataset's own TypeError ("list
    indices must be integers or slices, not tuple"; "int() argument must be ..."). They name the fix."""
    lengths = [250, 40, 90]
    rows = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    if kind == "hf":
        datasets = pytest.importorskip("datasets")
        rows = datasets.Dataset.from_list(rows)
    loader = DataLoader(rows, batch_sampler=PackedBatchSampler(lengths, 100, overflow="split"),
                        collate_fn=PackingCollator())
    with pytest.raises(TypeError, match=r"TokenSlice\(example=\d+, start=\d+, stop=\d+\): the sampler yields token "
                                        r"slices .* DataLoader\(SlicedDataset\(dataset\)"):
        next(iter(loader))


def test_state_dict_rejects_a_different_setup():
    sampler = PackedBatchSampler([5] * 40, 20, num_replicas=2, rank=0)
    state = sampler.state_dict()
    other = PackedBatchSampler([5] * 40, 20, num_replicas=4, rank=0)
    with pytest.raises(InputError, match="num_replicas"):
        other.load_state_dict(state)
    with pytest.raises(InputError, match="step"):
        sampler.load_state_dict({**state, "step": len(sampler) + 1})


def test_a_state_from_other_data_or_settings_is_refused():
    """Only counts were compared: a checkpoint of other data with as many examples and packs (or of shuffle=False)
    resumed silently, skipping some examples and repeating others."""
    lengths = [5, 3, 7, 2, 8, 1, 6, 4, 9, 3, 2, 7]
    sampler = PackedBatchSampler(lengths, 10, seed=0)
    batches = iter(sampler)
    next(batches)
    state = sampler.state_dict()
    with pytest.raises(InputError, match="state_dict: the packs differ"):
        PackedBatchSampler(lengths[::-1], 10, seed=0).load_state_dict(state)
    with pytest.raises(InputError, match="state_dict: shuffle is 1 in the checkpoint but 0 here"):
        PackedBatchSampler(lengths, 10, seed=0, shuffle=False).load_state_dict(state)
    with pytest.raises(InputError, match="state: expected the dict"):
        sampler.load_state_dict(None)
    with pytest.warns(UserWarning, match="saved by an earlier hybrid_pack"):
        PackedBatchSampler(lengths, 10, seed=0).load_state_dict({"epoch": 0, "step": 1})


def test_set_epoch_discards_a_resume_meant_for_another_epoch():
    sampler = PackedBatchSampler(list(range(1, 60)), 64)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 0, "step": 3})
    sampler.set_epoch(1)
    fresh = PackedBatchSampler(list(range(1, 60)), 64)
    fresh.set_epoch(1)
    assert list(sampler) == list(fresh)


@pytest.mark.parametrize("kwargs,field", [({"num_replicas": 0}, "num_replicas"),
                                          ({"rank": 2, "num_replicas": 2}, "rank"),
                                          ({"rank": True, "num_replicas": 2}, "rank"),
                                          ({"packs_per_step": 0}, "packs_per_step"), ({"seed": -1}, "seed"),
                                          ({"strategy": "best"}, "strategy"), ({"overflow": "wrap"}, "overflow")])
def test_bad_arguments_raise(kwargs, field):
    with pytest.raises(InputError, match=field):
        PackedBatchSampler([3, 4, 5], 8, **kwargs)


def test_all_dropped_raises():
    with pytest.raises(InputError, match="no example to pack"):
        PackedBatchSampler([30, 40], 8, overflow="drop")


def test_max_documents_feeds_the_static_collator() -> None:
    """With ``max_documents`` no step holds more documents than the static collator takes."""
    lengths = np.random.default_rng(5).integers(1, 30, 200)
    sampler = PackedBatchSampler(lengths, 64, max_documents=3, seed=2)
    collator = PackingCollator(pack_length=64, max_documents=3)
    dataset = [{"input_ids": [1] * int(n)} for n in lengths]
    seen = []
    for batch in DataLoader(dataset, batch_sampler=sampler, collate_fn=collator):
        seen.append(batch["cu_seq_lens_q"].shape)
    assert len(seen) == len(sampler) and set(seen) == {(5,)}
