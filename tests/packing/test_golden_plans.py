"""Golden plans: the exact pack assignments of fixed inputs, for every strategy, pinned.

A plan is a pure function of its inputs, so a refactor of the planner or of its kernels must leave
every pin below unchanged. The pins were captured from the planner as it was before the packing
layer was split into named steps. A deliberate change to a strategy moves them: print the new
values with ``.venv/bin/python -m tests.packing.test_golden_plans`` and say why in the commit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

from hybrid_pack import PackPlan, pack_rollouts, plan_packs
from hybrid_pack.data import load_lengths
from hybrid_pack.packing.plan import STRATEGIES

TINY_LENGTHS = [5, 3, 8, 2, 7, 4, 6, 1, 9, 3]
"""Ten examples, capacity 10: small enough to read the packs."""

TINY_PACKS = {
    "bfd": [[(7, 0, 1), (8, 0, 9)], [(2, 0, 8), (3, 0, 2)], [(1, 0, 3), (4, 0, 7)], [(5, 0, 4), (6, 0, 6)],
            [(0, 0, 5), (9, 0, 3)]],
    "ffd": [[(7, 0, 1), (8, 0, 9)], [(2, 0, 8), (3, 0, 2)], [(1, 0, 3), (4, 0, 7)], [(5, 0, 4), (6, 0, 6)],
            [(0, 0, 5), (9, 0, 3)]],
    "first_fit": [[(0, 0, 5), (1, 0, 3), (3, 0, 2)], [(2, 0, 8), (7, 0, 1)], [(4, 0, 7), (9, 0, 3)],
                  [(5, 0, 4), (6, 0, 6)], [(8, 0, 9)]],
    "next_fit": [[(0, 0, 5), (1, 0, 3)], [(2, 0, 8), (3, 0, 2)], [(4, 0, 7)], [(5, 0, 4), (6, 0, 6)],
                 [(7, 0, 1), (8, 0, 9)], [(9, 0, 3)]],
    "knapsack": [[(7, 0, 1), (8, 0, 9)], [(2, 0, 8), (3, 0, 2)], [(1, 0, 3), (4, 0, 7)], [(5, 0, 4), (6, 0, 6)],
                 [(0, 0, 5), (9, 0, 3)]],
}


def _uniform(seed: int, low: int, high: int, num: int) -> Callable[[], np.ndarray]:
    return lambda: np.random.default_rng(seed).integers(low, high, num)


def _bundled(table: str, column: str) -> Callable[[], np.ndarray]:
    return lambda: load_lengths(table)[column]


CASES: dict[str, tuple[Callable[[], np.ndarray], int, str, int | None]] = {
    # bfd / ffd: a repair round with single moves fails, then one with pair moves closes a pack.
    "uniform_pair_moves": (_uniform(1, 20, 70, 400), 100, "error", None),
    # bfd / ffd: three repair rounds close 20 packs, the fourth and fifth (pair moves) fail.
    "gsm8k_repair_rounds": (_bundled("gsm8k_train", "full_chatml"), 1024, "error", None),
    "gsm8k_seeded": (_bundled("gsm8k_test", "full_chatml"), 2048, "error", 5),
    "sky_t1_split": (_bundled("arena_hard_v2_sky_t1_32b", "full_chatml"), 4096, "split", None),
    "sky_t1_truncate_seeded": (_bundled("arena_hard_v2_sky_t1_32b", "last_turn_response"), 2048, "truncate", 0),
    "sky_t1_drop": (_bundled("arena_hard_v2_sky_t1_32b", "full_chatml"), 4096, "drop", None),
}

PLAN_DIGESTS = {
    "uniform_pair_moves": {"bfd": "d216583b13fc8461", "ffd": "d216583b13fc8461", "first_fit": "17c938b24d8ed3a9",
                           "next_fit": "ca7141234853fc9f", "knapsack": "c62894ad908f32c2"},
    "gsm8k_repair_rounds": {"bfd": "d5fe45bcc3ffc960", "ffd": "2230b89cd59c49b2", "first_fit": "fbed1bab32258f45",
                            "next_fit": "c19a23a410f20234", "knapsack": "1b0d9316a00f2d3b"},
    "gsm8k_seeded": {"bfd": "d5410def15330058", "ffd": "d5410def15330058", "first_fit": "c51f616dd65d1617",
                     "next_fit": "04c3c645fd76529f", "knapsack": "daa610aceae0f2f3"},
    "sky_t1_split": {"bfd": "720db3d2c1619e3a", "ffd": "fec0c37f5bf3441e", "first_fit": "31252b016e0793c4",
                     "next_fit": "e4d5a7788a3f3ebf", "knapsack": "b015448965bb51ec"},
    "sky_t1_truncate_seeded": {"bfd": "3d447adc147f2a5b", "ffd": "7fdf8b8e2851eab0", "first_fit": "16cbc9cde8b9a72f",
                               "next_fit": "e7d6a5512feba275", "knapsack": "41bf33546ca2230d"},
    "sky_t1_drop": {"bfd": "1a6b99ef36d58e00", "ffd": "f44d901f760aa0bb", "first_fit": "6ee62107b4645dd3",
                    "next_fit": "1b951610423d3c02", "knapsack": "e60a042dc7f3fd5b"},
}

ROLLOUT_DIGESTS = {"bfd": "b29f4a65a2a7d6c1", "knapsack": "85bb1b007f52e955", "next_fit": "b0b2a3fab6b15676"}


def _digest(*arrays: np.ndarray) -> str:
    """First 16 hex digits of the SHA-256 of the arrays' little-endian int64 bytes."""
    sha = hashlib.sha256()
    for array in arrays:
        sha.update(np.ascontiguousarray(array, dtype="<i8").tobytes())
        sha.update(b"|")
    return sha.hexdigest()[:16]


def _plan_digest(plan: PackPlan) -> str:
    return _digest(plan.example_index, plan.start, plan.stop, plan.pack_offsets)


def _plan(case: str, strategy: str) -> PackPlan:
    lengths, capacity, overflow, seed = CASES[case]
    return plan_packs(lengths(), capacity, strategy=strategy, overflow=overflow, seed=seed)


def _rollout_batches(strategy: str) -> list[dict]:
    """Fixed rollouts (scalar advantages, tool outputs, padding) packed with one strategy."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 500, rng.integers(1, 30)).tolist() for _ in range(60)]
    responses = [rng.integers(0, 500, rng.integers(1, 40)).tolist() for _ in range(60)]
    tool_masks = [(rng.random(len(r)) < 0.3).astype(int).tolist() for r in responses]
    advantages = rng.normal(size=60).astype(np.float32).tolist()
    old_logprobs = [(-rng.random(len(r))).astype(np.float32).tolist() for r in responses]
    return pack_rollouts(prompts, responses, 96, tool_masks=tool_masks, advantages=advantages,
                         old_logprobs=old_logprobs, strategy=strategy, pad_to_multiple_of=8)


def _batches_digest(batches: list[dict]) -> str:
    """SHA-256 (16 hex digits) of every batch: its keys in order, each value's dtype, shape and bytes."""
    sha = hashlib.sha256()
    for batch in batches:
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                sha.update(f"{key}:{value.dtype}:{list(value.shape)}:".encode())
                sha.update(value.contiguous().numpy().tobytes())
            else:
                sha.update(f"{key}={value!r}".encode())
        sha.update(b"|")
    return sha.hexdigest()[:16]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tiny_plan_is_pinned(strategy):
    assert plan_packs(TINY_LENGTHS, 10, strategy=strategy).packs() == TINY_PACKS[strategy]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", list(CASES))
def test_plan_is_pinned(case, strategy):
    assert _plan_digest(_plan(case, strategy)) == PLAN_DIGESTS[case][strategy]


@pytest.mark.parametrize("strategy", ["bfd", "knapsack", "next_fit"])
def test_rollout_batches_are_pinned(strategy):
    assert _batches_digest(_rollout_batches(strategy)) == ROLLOUT_DIGESTS[strategy]


if __name__ == "__main__":
    print("TINY_PACKS =", {strategy: plan_packs(TINY_LENGTHS, 10, strategy=strategy).packs()
                           for strategy in STRATEGIES})
    print("PLAN_DIGESTS =", {case: {strategy: _plan_digest(_plan(case, strategy)) for strategy in STRATEGIES}
                             for case in CASES})
    print("ROLLOUT_DIGESTS =", {strategy: _batches_digest(_rollout_batches(strategy))
                                for strategy in ("bfd", "knapsack", "next_fit")})
