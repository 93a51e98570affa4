"""Token cost of packs and their assignment to data-parallel ranks.

Packs hold about the same number of tokens, but not the same work: attention costs grow with the
square of each document's length, so a pack holding one 8k-token document takes longer than a pack
of forty 200-token documents. Synchronous data parallelism waits for the slowest rank at every
step, so the packs of one step should cost the same on every rank.

:class:`TokenCost` prices a document; :func:`assign_packs` lays packs out as
``[steps, ranks, packs_per_step]`` so that every rank gets the same number of steps, the packs of a
step cost about the same on every rank, and every rank's total over the epoch is about the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid_pack.errors import InputError

__all__ = ["BalanceStats", "TokenCost", "assign_packs", "balance_stats", "pack_costs"]


@dataclass(frozen=True)
class TokenCost:
    """Cost of a document of ``n`` tokens: ``linear * n + quadratic * n**2`` (arbitrary units).

    The linear term covers every per-token layer (MLP, projections, Gated DeltaNet, Mamba-2, conv);
    the quadratic term covers causal softmax attention. Per layer of hidden size ``d`` a token costs
    about ``24 d**2`` FLOPs in the linear layers and a causal attention layer about ``2 d n`` per
    token, so with a fraction ``f`` of the layers being attention ``quadratic / linear = f / (12 d)``
    (:meth:`for_model`). The default, ``2**-16``, is a hidden size of 2048 with a quarter of the layers
    attention (``0.25 / 24576 = 1.0e-5``) rounded up; at 8192 tokens the quadratic term is 12.5% of
    the linear one.
    """

    linear: float = 1.0
    quadratic: float = 2.0**-16

    def __post_init__(self) -> None:
        if self.linear < 0 or self.quadratic < 0 or self.linear + self.quadratic <= 0:
            raise InputError(f"TokenCost: expected linear >= 0 and quadratic >= 0, not both 0; "
                             f"got linear={self.linear}, quadratic={self.quadratic}")

    @classmethod
    def for_model(cls, hidden_size: int, num_layers: int, num_attention_layers: int) -> TokenCost:
        """The cost of a model with ``num_attention_layers`` softmax-attention layers out of ``num_layers``."""
        if hidden_size < 1 or num_layers < 1 or not 0 <= num_attention_layers <= num_layers:
            raise InputError(f"for_model: expected hidden_size >= 1, num_layers >= 1 and "
                             f"0 <= num_attention_layers <= num_layers; got {hidden_size}, {num_layers}, "
                             f"{num_attention_layers}")
        return cls(linear=1.0, quadratic=num_attention_layers / (num_layers * 12.0 * hidden_size))

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        """float64 cost of every document, same shape as ``lengths``."""
        n = np.asarray(lengths, dtype=np.float64)
        return self.linear * n + self.quadratic * n * n


def pack_costs(item_lengths: np.ndarray, pack_offsets: np.ndarray, cost: TokenCost) -> np.ndarray:
    """float64 ``[P]``: summed document cost of every pack, items stored CSR style (``pack_offsets [P+1]``)."""
    num_packs = pack_offsets.shape[0] - 1
    pack_of_item = np.repeat(np.arange(num_packs), np.diff(pack_offsets))
    return np.bincount(pack_of_item, weights=cost(item_lengths), minlength=num_packs)


def assign_packs(costs: np.ndarray, num_replicas: int, packs_per_step: int, *,
                 rng: np.random.Generator | None = None, jitter: float = 0.01) -> np.ndarray:
    """Lay ``P`` packs out as int64 ``[P // (R*k), R, k]`` (steps, ranks, packs per step) of pack ids.

    Packs are sorted by cost (heaviest first) and cut into consecutive groups of ``R*k``: the packs of
    one step therefore cost about the same. Inside a step the packs go out in rounds of ``R``,
    heaviest first, each round to the ranks ordered by their load so far in this step and then over
    the epoch (longest-processing-time first), which evens out both the step and the epoch totals.

    Args:
        costs: float ``[P]`` pack costs; ``P`` must be a multiple of ``R*k``.
        num_replicas: ``R``, data-parallel ranks.
        packs_per_step: ``k``, packs each rank takes per step.
        rng: when given, the sort key is ``cost * (1 + jitter * u)`` with ``u ~ U[0, 1)`` so packs of
            nearly equal cost meet different partners each epoch, and the steps are shuffled.
            ``None`` keeps the heaviest-first order.
        jitter: relative noise on the sort key (bounds the extra step imbalance it can cause).

    Returns:
        int64 ``[steps, R, k]``; every pack id appears exactly once.
    """
    costs = np.asarray(costs, dtype=np.float64)
    group = num_replicas * packs_per_step
    if costs.ndim != 1 or costs.shape[0] % group:
        raise InputError(f"costs: expected a 1-D array whose length is a multiple of num_replicas * packs_per_step "
                         f"= {group}; got shape {list(costs.shape)}")
    num_steps = costs.shape[0] // group
    key = costs if rng is None else costs * (1.0 + jitter * rng.random(costs.shape[0]))
    steps = np.argsort(-key, kind="stable").reshape(num_steps, group)
    layout = np.empty((num_steps, num_replicas, packs_per_step), dtype=np.int64)
    epoch_load = np.zeros(num_replicas)
    for s in range(num_steps):
        packs = steps[s][np.argsort(-costs[steps[s]], kind="stable")]
        step_load = np.zeros(num_replicas)
        for j in range(packs_per_step):
            ranks = np.lexsort((epoch_load, step_load))
            round_packs = packs[j * num_replicas:(j + 1) * num_replicas]
            layout[s, ranks, j] = round_packs
            step_load[ranks] += costs[round_packs]
        epoch_load += step_load
    if rng is not None:
        layout = layout[rng.permutation(num_steps)]
    return layout


@dataclass(frozen=True)
class BalanceStats:
    """How evenly work is spread over ranks.

    Attributes:
        epoch_max_over_mean: the most loaded rank's epoch total over the mean rank total (1.0 = even).
        step_max_over_mean: sum over steps of the slowest rank's cost over the sum of the mean rank
            cost: the time a synchronous step spends waiting on stragglers (1.0 = none).
        num_steps: steps per rank.
    """

    epoch_max_over_mean: float
    step_max_over_mean: float
    num_steps: int


def balance_stats(step_costs: np.ndarray) -> BalanceStats:
    """Balance of a float ``[steps, R]`` array of per-rank step costs."""
    step_costs = np.asarray(step_costs, dtype=np.float64)
    if step_costs.ndim != 2 or step_costs.size == 0:
        raise InputError(f"step_costs: expected a non-empty [steps, ranks] array; got shape {list(step_costs.shape)}")
    totals = step_costs.sum(axis=0)
    return BalanceStats(
        epoch_max_over_mean=float(totals.max() / totals.mean()),
        step_max_over_mean=float(step_costs.max(axis=1).sum() / step_costs.mean(axis=1).sum()),
        num_steps=int(step_costs.shape[0]),
    )
