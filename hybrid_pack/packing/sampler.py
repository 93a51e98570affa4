"""A distributed batch sampler that yields whole packs, balanced by token cost across ranks.

``DataLoader(dataset, batch_sampler=PackedBatchSampler(lengths, capacity, num_replicas=R, rank=r),
collate_fn=PackingCollator())`` gives every rank one packed row per step.

How an epoch is laid out (all ranks compute the same layout, no communication):

1. The packs are planned once with :func:`~hybrid_pack.plan_packs`.
2. If the pack count ``P`` is not a multiple of ``R * packs_per_step``, the packs holding the most
   documents are split in two (documents alternate between the halves, longest first) until it is.
   Nothing is dropped or repeated. Only when there are fewer documents than the steps need
   (``documents < ceil(P / (R*k)) * R*k``, tiny datasets) are the cheapest packs repeated to fill the
   last step; the sampler warns and reports it in :attr:`PackedBatchSampler.num_repeated_packs`.
3. Every epoch the packs are laid out as ``[steps, R, k]`` by :func:`~hybrid_pack.packing.balance.assign_packs`
   (cost-sorted groups per step, longest-processing-time rounds inside a step) with a generator
   seeded by ``(seed, epoch)``, and the steps are shuffled (``shuffle=True``).

So the order is a pure function of (lengths, capacity, strategy, overflow, seed, epoch,
num_replicas, packs_per_step); ranks get disjoint packs and the same number of steps, and every
kept document is seen exactly once per epoch across ranks.
"""

from __future__ import annotations

import hashlib
import heapq
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from hybrid_pack.errors import InputError
from hybrid_pack.packing.balance import BalanceStats, TokenCost, assign_packs, balance_stats, pack_costs
from hybrid_pack.packing.plan import PackPlan, plan_packs
from hybrid_pack.packing.slicing import TokenSlice

__all__ = ["PackedBatchSampler"]

Batch = list[int] | list[tuple[int, int, int]]


def _check_int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InputError(f"{field}: expected an int >= {minimum}; got {value!r}")
    return int(value)


def _halves(items: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split item ids in two groups of near-equal tokens: longest first, alternating; each kept in order."""
    by_length = items[np.argsort(-lengths[items], kind="stable")]
    return np.sort(by_length[0::2]), np.sort(by_length[1::2])


def _packs_to_multiple(plan: PackPlan, multiple: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The plan's packs, split (or, failing that, repeated) until their count is a multiple of ``multiple``.

    Returns ``(items, pack_offsets, num_repeated)``: int64 item ids into the plan's item arrays stored
    pack after pack, int64 ``[P'+1]`` CSR offsets, and how many packs at the end are repeats.
    """
    offsets = plan.pack_offsets
    extra = -len(plan) % multiple
    if extra == 0:
        return np.arange(plan.num_documents, dtype=np.int64), offsets, 0
    packs = [np.arange(offsets[p], offsets[p + 1]) for p in range(len(plan))]
    lengths = plan.item_lengths
    heap = [(-len(items), p) for p, items in enumerate(packs) if len(items) > 1]
    heapq.heapify(heap)
    while extra and heap:
        _, p = heapq.heappop(heap)
        first, second = _halves(packs[p], lengths)
        packs[p] = first
        packs.append(second)
        extra -= 1
        for pack_id in (p, len(packs) - 1):
            if len(packs[pack_id]) > 1:
                heapq.heappush(heap, (-len(packs[pack_id]), pack_id))
    if extra:
        tokens = np.array([lengths[items].sum() for items in packs])
        cheapest = np.argsort(tokens, kind="stable")
        packs += [packs[cheapest[i % len(packs)]] for i in range(extra)]
    pack_offsets = np.zeros(len(packs) + 1, dtype=np.int64)
    np.cumsum([len(items) for items in packs], out=pack_offsets[1:])
    return np.concatenate(packs), pack_offsets, extra


class PackedBatchSampler(Sampler[Batch]):
    """Batch sampler over packs: each step yields the items of ``packs_per_step`` packs of this rank.

    Args:
        lengths: int ``[N]``, token count of every example of the dataset (each >= 1).
        capacity: tokens per pack.
        num_replicas: data-parallel ranks ``R``.
        rank: this rank, ``0..R-1``. ``None`` yields the steps of all ranks interleaved (batch ``i``
            belongs to rank ``i % R``), the layout accelerate's ``BatchSamplerShard`` expects (see
            ``docs/distributed.md``).
        seed: seeds the per-epoch layout; the same on every rank.
        shuffle: shuffle which packs share a step and the order of the steps, per epoch. With
            ``False`` steps go heaviest first, the same every epoch.
        strategy, overflow: passed to :func:`~hybrid_pack.plan_packs`.
        packs_per_step: ``k`` packs per rank per step, yielded as ONE flat list of items, pack after
            pack; :class:`~hybrid_pack.PackingCollator` turns it into one row of up to
            ``k * capacity`` tokens (the same row it builds from the list of packs).
        cost: prices documents for balancing (:class:`~hybrid_pack.packing.balance.TokenCost`).
        max_documents: no pack holds more documents (:func:`~hybrid_pack.plan_packs`); with ``packs_per_step``
            ``k``, a step's row holds at most ``k * max_documents`` (the static collator's ``max_documents``).

    Items are example indices (ints) for ``overflow="error"`` / ``"drop"``. For ``"truncate"`` and
    ``"split"`` they are :class:`~hybrid_pack.packing.slicing.TokenSlice` ``(index, start, stop)`` tuples: wrap the
    dataset in :class:`~hybrid_pack.packing.slicing.SlicedDataset` (a dataset indexed by example raises a
    ``TypeError`` saying so).

    ``state_dict()`` / ``load_state_dict()`` record ``(epoch, step)``: the batches this sampler has
    yielded in the current epoch. After loading, the next iteration resumes at that step with the
    exact batches the interrupted run would have produced. A DataLoader with workers prefetches
    ahead of the training loop; save the loop's own step count in that case
    (``{**sampler.state_dict(), "step": steps_done}``).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        capacity: int,
        *,
        num_replicas: int = 1,
        rank: int | None = 0,
        seed: int = 0,
        shuffle: bool = True,
        strategy: str = "bfd",
        overflow: str = "error",
        packs_per_step: int = 1,
        cost: TokenCost | None = None,
        max_documents: int | None = None,
    ) -> None:
        self.num_replicas = _check_int("num_replicas", num_replicas, 1)
        if rank is not None and (isinstance(rank, bool) or not (isinstance(rank, (int, np.integer))
                                                                and 0 <= rank < num_replicas)):
            raise InputError(f"rank: expected an int in [0, {num_replicas}) or None (all ranks interleaved); "
                             f"got {rank!r}")
        self.rank = None if rank is None else int(rank)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.packs_per_step = _check_int("packs_per_step", packs_per_step, 1)
        self.cost = cost if cost is not None else TokenCost()
        self.plan = plan_packs(lengths, capacity, strategy=strategy, overflow=overflow, seed=self.seed,
                               max_documents=max_documents)
        if self.plan.num_documents == 0:
            raise InputError("lengths: no example to pack (the list is empty, or overflow='drop' dropped every "
                             "example as longer than capacity: raise capacity or use overflow='truncate' or 'split')")
        self._yields_slices = overflow in ("truncate", "split")

        group = self.num_replicas * self.packs_per_step
        self._items, self._pack_offsets, self.num_repeated_packs = _packs_to_multiple(self.plan, group)
        self.num_steps = self.num_packs // group
        if self.num_repeated_packs:
            warnings.warn(f"PackedBatchSampler: {self.plan.num_documents} documents cannot fill "
                          f"{self.num_steps} steps of {self.num_replicas} ranks x {self.packs_per_step} packs; "
                          f"the {self.num_repeated_packs} cheapest packs are repeated to fill the last step",
                          stacklevel=2)
        self.pack_costs = pack_costs(self.plan.item_lengths[self._items], self._pack_offsets, self.cost)

        self._epoch = 0
        self._yielded = 0
        self._resume_step = 0
        self._cached_layout: tuple[int, np.ndarray] | None = None

    # ------------------------------------------------------------------ layout
    @property
    def num_packs(self) -> int:
        """Packs per epoch over all ranks (a multiple of ``num_replicas * packs_per_step``)."""
        return self._pack_offsets.shape[0] - 1

    @property
    def epoch(self) -> int:
        return self._epoch

    def layout(self, epoch: int | None = None) -> np.ndarray:
        """int64 ``[steps, R, k]``: the pack ids every rank takes at every step of ``epoch`` (default: current)."""
        epoch = self._epoch if epoch is None else _check_int("epoch", epoch, 0)
        if self._cached_layout is None or self._cached_layout[0] != epoch:
            rng = np.random.default_rng((self.seed, epoch)) if self.shuffle else None
            layout = assign_packs(self.pack_costs, self.num_replicas, self.packs_per_step, rng=rng)
            self._cached_layout = (epoch, layout)
        return self._cached_layout[1]

    def balance(self, epoch: int | None = None) -> BalanceStats:
        """How evenly token cost is spread over ranks in ``epoch`` (default: current)."""
        return balance_stats(self.pack_costs[self.layout(epoch)].sum(axis=2))

    def pack_items(self, pack: int) -> Batch:
        """The items of one pack (a pack id of :meth:`layout`): example indices or ``(index, start, stop)``."""
        if not 0 <= pack < self.num_packs:
            raise IndexError(f"pack: expected an id in [0, {self.num_packs}); got {pack}")
        return self._batch([pack])

    def _batch(self, packs: Sequence[int] | np.ndarray) -> Batch:
        items = np.concatenate([self._items[self._pack_offsets[p]:self._pack_offsets[p + 1]] for p in packs])
        plan = self.plan
        if self._yields_slices:
            return list(map(TokenSlice, plan.example_index[items].tolist(), plan.start[items].tolist(),
                            plan.stop[items].tolist()))
        return plan.example_index[items].tolist()

    # --------------------------------------------------------------- sampling
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration walks. A pending resume is kept only for the same epoch."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch, self._yielded, self._resume_step = epoch, 0, 0

    def __len__(self) -> int:
        """Batches a whole epoch yields: steps per rank, or steps x ranks with ``rank=None`` (an iteration resumed
        by :meth:`load_state_dict` yields those from its step on)."""
        return self.num_steps * (self.num_replicas if self.rank is None else 1)

    def __iter__(self) -> Iterator[Batch]:
        layout = self.layout()
        start, self._resume_step = self._resume_step, 0
        self._yielded = start
        for batch_index in range(start, len(self)):
            if self.rank is None:
                step, rank = divmod(batch_index, self.num_replicas)
            else:
                step, rank = batch_index, self.rank
            batch = self._batch(layout[step, rank])
            self._yielded = batch_index + 1
            yield batch

    # ------------------------------------------------------------ resumption
    def _fingerprint(self) -> dict[str, int | str]:
        plan = self.plan
        digest = hashlib.sha1(b"".join(np.ascontiguousarray(a).tobytes() for a in (
            plan.example_index, plan.start, plan.stop, self._items, self._pack_offsets))).hexdigest()[:16]
        return {"seed": self.seed, "num_replicas": self.num_replicas, "packs_per_step": self.packs_per_step,
                "num_packs": self.num_packs, "num_examples": self.plan.num_examples, "capacity": self.plan.capacity,
                "batches_per_epoch": len(self), "shuffle": int(self.shuffle), "cost": repr(self.cost), "plan": digest}

    def state_dict(self) -> dict[str, int | str]:
        """``epoch``, ``step`` (batches yielded in this epoch) and the settings a resume must share (``plan``: a
        digest of the packs, so other data or packing settings with the same counts are told apart)."""
        return {"epoch": self._epoch, "step": self._yielded, **self._fingerprint()}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Resume: the next iteration yields the batches of ``state["epoch"]`` from ``state["step"]`` on
        (none if the epoch was complete); later iterations start from the beginning again."""
        if not isinstance(state, dict):
            raise InputError(f"state: expected the dict state_dict() returned; got {type(state).__name__}")
        missing = [key for key in self._fingerprint() if key not in state]
        if missing:  # saved by an earlier version: what it holds is checked, the rest cannot be
            warnings.warn(f"state_dict: the checkpoint has no {missing} (saved by an earlier hybrid_pack): the resume "
                          "cannot check that the data and settings are the interrupted run's", stacklevel=2)
        for key, value in self._fingerprint().items():
            if key in state and state[key] != value:
                what = "the packs differ: other data or packing settings" if key == "plan" else \
                    f"{key} is {state[key]} in the checkpoint but {value} here"
                raise InputError(f"state_dict: {what}; resume with the data and sampler settings of the "
                                 f"interrupted run")
        epoch = _check_int("epoch", state.get("epoch"), 0)
        step = _check_int("step", state.get("step"), 0)
        if step > len(self):
            raise InputError(f"step: expected at most {len(self)} (batches per epoch); got {step}")
        self._epoch, self._yielded, self._resume_step = epoch, step, step
