"""Bin-packing kernels: put items of integer size into bins of a fixed capacity.

:func:`assign_bins` runs one strategy on ``sizes`` (int64 ``[M]``, each in ``1..capacity``) and
``order`` (int64 ``[M]``, a permutation of ``range(M)``: the order items are considered in, or in
which equal sizes are taken) and returns ``(bin_of_item, num_bins)``: int64 ``[M]`` bin ids
numbered in the order the bins were opened, and their count. The online kernels (best fit, first
fit, next fit) read the sizes in the order they consider them, so the decreasing strategies first
sort the items with a counting sort. Everything is compiled with numba and works on flat arrays:
no Python object per item, millions of items in well under a second.

Strategies (``M`` items, capacity ``C``):

* ``bfd`` — best-fit decreasing + a gap-closing repair pass. Construction: largest item first,
  into the open bin it fills most tightly; O(M log C) with a presence tree over free space
  ``0..C`` and a queue of bins per free space. Then :func:`_close_gaps`.
* ``ffd`` — first-fit decreasing + the same repair pass. Construction: largest item first, into
  the lowest-numbered bin it fits; O(M log M) with a max-tree over the free space of every bin.
* ``first_fit`` — first fit in input order (packs keep the input order as far as possible).
* ``next_fit`` — input order, one open bin; a new bin whenever the item does not fit. O(M).
* ``knapsack`` — fill one bin at a time: open it with the largest remaining item, then add the
  largest remaining item that fits, except that when at most three remaining items fill the bin
  exactly they go in instead. Without that exact-fill search this would reproduce FFD item for
  item; with it, bins close full far more often. O(M log C) plus a search of at most O(C) probes
  per step, run only when three items could fill the bin.

The repair pass (:func:`_close_gaps`) is a bounded, deterministic local search run after the
greedy ``bfd`` / ``ffd`` packing while it is above ``ceil(sum(sizes) / C)``: dissolve a few bins
spread over the packing into a pool, refill the free space of every other bin from the pool
(add a pool item, or swap a bin's item for a larger pool item, or for two pool items, the swapped
item joining the pool), pack what is left of the pool best-fit decreasing, and keep the result
only if it has fewer bins. At most 8 rounds of O(M + bins * items per bin * log C) each.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["ORDER_KEEPING", "STRATEGIES", "assign_bins", "group_by_bin"]

_REFILL_ROUNDS = 8
"""Most rounds of the gap-closing pass (failed ones included)."""

_REFILL_SWEEPS = 2
"""Most sweeps over the kept bins in one round."""

_PAIR_PROBES = 8
"""Most pool sizes tried when looking for two pool items of a given sum."""

STRATEGIES = ("bfd", "ffd", "first_fit", "next_fit", "knapsack")
"""Valid strategy names, default first."""

ORDER_KEEPING = frozenset({"first_fit", "next_fit"})
"""Strategies that consider items in input order; the others sort by size and only use ``order`` for ties."""


@njit(cache=True)
def _tree_leaves(num_keys: int) -> int:
    """Smallest power of two >= ``num_keys`` (the leaf count of a complete binary tree)."""
    leaves = 1
    while leaves < num_keys:
        leaves *= 2
    return leaves


@njit(cache=True)
def _set_presence(tree: np.ndarray, leaves: int, key: int, present: bool) -> None:
    """Mark ``key`` present or absent in a presence tree (a node is set iff a leaf below it is)."""
    node = leaves + key
    tree[node] = present
    node >>= 1
    while node >= 1:
        merged = tree[2 * node] or tree[2 * node + 1]
        if tree[node] == merged:
            return
        tree[node] = merged
        node >>= 1


@njit(cache=True)
def _first_present_at_or_above(tree: np.ndarray, leaves: int, key: int) -> int:
    """Smallest present key >= ``key``, or -1."""
    node = leaves + key
    if tree[node]:
        return key
    while node > 1:
        if node % 2 == 0 and tree[node + 1]:
            node += 1
            while node < leaves:
                node = 2 * node if tree[2 * node] else 2 * node + 1
            return node - leaves
        node >>= 1
    return -1


@njit(cache=True)
def _last_present_at_or_below(tree: np.ndarray, leaves: int, key: int) -> int:
    """Largest present key <= ``key``, or -1."""
    node = leaves + key
    if tree[node]:
        return key
    while node > 1:
        if node % 2 == 1 and tree[node - 1]:
            node -= 1
            while node < leaves:
                node = 2 * node + 1 if tree[2 * node + 1] else 2 * node
            return node - leaves
        node >>= 1
    return -1


@njit(cache=True)
def _sort_descending(sizes: np.ndarray, order: np.ndarray, capacity: int) -> np.ndarray:
    """``order`` stably sorted by size, largest first (a counting sort: O(M + C))."""
    starts = np.zeros(capacity + 2, np.int64)
    for i in order:
        starts[capacity - sizes[i] + 1] += 1
    for key in range(1, capacity + 2):
        starts[key] += starts[key - 1]
    out = np.empty_like(order)
    for i in order:
        key = capacity - sizes[i]
        out[starts[key]] = i
        starts[key] += 1
    return out


@njit(cache=True)
def _best_fit(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Each item, in the order given, goes to the open bin with the least free space that still holds it.

    Open bins are bucketed by free space ``r``: ``head[r]`` / ``tail[r]`` / ``next_bin`` form a queue
    of the bins with exactly ``r`` free (ties go to the bin that reached ``r`` first), and a presence
    tree over ``r`` finds the smallest ``r >= size`` in O(log C). Full bins leave the structure.
    """
    num_items = sizes.shape[0]
    bins = np.empty(num_items, np.int64)
    leaves = _tree_leaves(capacity + 1)
    has_bin = np.zeros(2 * leaves, np.bool_)
    head = np.full(capacity + 1, -1, np.int64)
    tail = np.full(capacity + 1, -1, np.int64)
    next_bin = np.empty(num_items, np.int64)
    num_bins = 0
    for k in range(num_items):
        size = sizes[k]
        free = _first_present_at_or_above(has_bin, leaves, size)
        if free < 0:
            b = num_bins
            num_bins += 1
            free = capacity
        else:
            b = head[free]
            head[free] = next_bin[b]
            if head[free] < 0:
                _set_presence(has_bin, leaves, free, False)
        bins[k] = b
        free -= size
        if free > 0:
            next_bin[b] = -1
            if head[free] < 0:
                head[free] = b
                _set_presence(has_bin, leaves, free, True)
            else:
                next_bin[tail[free]] = b
            tail[free] = b
    return bins, num_bins


# A refill round keeps every item on exactly one list, linked through ``next_item`` (int64 ``[M]``,
# -1 ends a list): the list of the kept bin it is in (first item ``bin_head[b]``; ``bin_of[i]`` is
# that bin) or, for a loose item (``bin_of[i] == -1``), the pool stack of its size (top item
# ``pool_head[s]``, ``pool_count[s]`` items). ``has_size`` is a presence tree over the sizes with a
# pool item; the helpers below read its leaf count from its length. The steps run for every bin or
# every probe are compiled into their caller (``inline="always"``): a numba call increments and
# decrements the reference count of each array argument, which costs more than these steps do.


@njit(cache=True, inline="always")
def _largest_in_pool(has_size: np.ndarray, limit: int) -> int:
    """The largest size ``<= limit`` with an item in the pool, or -1."""
    return _last_present_at_or_below(has_size, has_size.shape[0] // 2, limit)


@njit(cache=True)
def _pool_push(pool_head: np.ndarray, pool_count: np.ndarray, has_size: np.ndarray, next_item: np.ndarray,
               sizes: np.ndarray, item: int) -> None:
    """Put ``item`` on the pool stack of its size."""
    size = sizes[item]
    if pool_count[size] == 0:
        _set_presence(has_size, has_size.shape[0] // 2, size, True)
    next_item[item] = pool_head[size]
    pool_head[size] = item
    pool_count[size] += 1


@njit(cache=True)
def _pool_pop(pool_head: np.ndarray, pool_count: np.ndarray, has_size: np.ndarray, next_item: np.ndarray,
              size: int) -> int:
    """Take an item of ``size`` (present) off the pool."""
    item = pool_head[size]
    pool_head[size] = next_item[item]
    pool_count[size] -= 1
    if pool_count[size] == 0:
        _set_presence(has_size, has_size.shape[0] // 2, size, False)
    return item


@njit(cache=True, inline="always")
def _pool_pair(pool_count: np.ndarray, has_size: np.ndarray, target: int, budget: int) -> int:
    """The larger size ``a`` of two pool items ``a >= target - a`` that sum to ``target``; 0 after ``budget`` probes."""
    a = _largest_in_pool(has_size, target - 1)
    for _ in range(budget):
        if a < 1 or 2 * a < target:
            break
        if pool_count[target - a] > (1 if 2 * a == target else 0):
            return a
        a = _largest_in_pool(has_size, a - 1)
    return 0


@njit(cache=True)
def _dissolved_bins(num_bins: int, num_pool: int, offset: int) -> np.ndarray:
    """bool ``[B]``: the ``num_pool`` bins a round dissolves, spread evenly over the opening order.

    Bin ``b`` is dissolved when ``(num_bins - 1 - b + offset) * num_pool % num_bins < num_pool``, so
    rounds with another ``offset`` dissolve other bins.
    """
    dissolved = np.zeros(num_bins, np.bool_)
    for b in range(num_bins):
        dissolved[b] = (num_bins - 1 - b + offset) * num_pool % num_bins < num_pool
    return dissolved


@njit(cache=True)
def _bin_loads(sizes: np.ndarray, bins: np.ndarray, num_bins: int) -> np.ndarray:
    """int64 ``[B]``, tokens in each bin."""
    load = np.zeros(num_bins, np.int64)
    for i in range(sizes.shape[0]):
        load[bins[i]] += sizes[i]
    return load


@njit(cache=True)
def _split_items(sizes: np.ndarray, bins: np.ndarray, dissolved: np.ndarray,
                 capacity: int) -> tuple[np.ndarray, ...]:
    """The items of dissolved bins go to the pool, the others onto the list of their bin, each list in item order.

    Returns ``(pool_head, pool_count, has_size, bin_head, bin_of, next_item)``, the round's lists.
    """
    num_items = sizes.shape[0]
    has_size = np.zeros(2 * _tree_leaves(capacity + 1), np.bool_)
    pool_head = np.full(capacity + 1, -1, np.int64)
    pool_count = np.zeros(capacity + 1, np.int64)
    bin_head = np.full(dissolved.shape[0], -1, np.int64)
    next_item = np.full(num_items, -1, np.int64)
    bin_of = bins.copy()
    for i in range(num_items - 1, -1, -1):
        b = bins[i]
        if dissolved[b]:
            bin_of[i] = -1
            _pool_push(pool_head, pool_count, has_size, next_item, sizes, i)
        else:
            next_item[i] = bin_head[b]
            bin_head[b] = i
    return pool_head, pool_count, has_size, bin_head, bin_of, next_item


@njit(cache=True, inline="always")
def _best_single_move(sizes: np.ndarray, has_size: np.ndarray, bin_head: np.ndarray, next_item: np.ndarray, b: int,
                      free: int, capacity: int) -> tuple[int, int, int]:
    """The move of one pool item into bin ``b`` that fills most of its ``free`` tokens.

    Either add the largest pool item ``<= free``, or swap one of the bin's items ``y`` for the
    largest pool item ``<= y + free``; adding wins a tie, then the swap of the earliest item.
    Returns ``(gain, out, out_prev)``: tokens gained, the item swapped out (-1 when adding) and the
    one before it in the bin's list (-1 when it is first).
    """
    gain = max(_largest_in_pool(has_size, free), 0)
    out, out_prev = -1, -1
    prev, i = -1, bin_head[b]
    while i >= 0 and gain < free:
        size = sizes[i]
        x = _largest_in_pool(has_size, min(size + free, capacity))
        if x - size > gain:
            gain, out, out_prev = x - size, i, prev
        prev, i = i, next_item[i]
    return gain, out, out_prev


@njit(cache=True, inline="always")
def _pair_swap(sizes: np.ndarray, pool_count: np.ndarray, has_size: np.ndarray, bin_head: np.ndarray,
               next_item: np.ndarray, b: int, free: int, capacity: int) -> tuple[int, int, int]:
    """The first item ``y`` of bin ``b`` that two pool items summing to ``y + free`` can replace.

    Returns ``(out, out_prev, pair)``: the item ``y``, the one before it in the bin's list (-1 when
    it is first) and the larger size of the two pool items (:func:`_pool_pair`); ``(-1, -1, 0)``
    when no item of the bin has such a pair.
    """
    prev, i = -1, bin_head[b]
    while i >= 0:
        if sizes[i] + free <= capacity:
            pair = _pool_pair(pool_count, has_size, sizes[i] + free, _PAIR_PROBES)
            if pair > 0:
                return i, prev, pair
        prev, i = i, next_item[i]
    return -1, -1, 0


@njit(cache=True)
def _add_to_bin(bin_head: np.ndarray, bin_of: np.ndarray, next_item: np.ndarray, b: int, item: int) -> None:
    """Put ``item`` first in the list of bin ``b``."""
    next_item[item] = bin_head[b]
    bin_head[b] = item
    bin_of[item] = b


@njit(cache=True)
def _replace_in_bin(bin_head: np.ndarray, bin_of: np.ndarray, next_item: np.ndarray, b: int, old: int,
                    old_prev: int, item: int) -> None:
    """Put ``item`` where ``old`` is in the list of bin ``b`` (``old_prev``: the item before ``old``, or -1)."""
    next_item[item] = next_item[old]
    if old_prev < 0:
        bin_head[b] = item
    else:
        next_item[old_prev] = item
    bin_of[item] = b


@njit(cache=True)
def _sweep(sizes: np.ndarray, pool_head: np.ndarray, pool_count: np.ndarray, has_size: np.ndarray,
           bin_head: np.ndarray, bin_of: np.ndarray, next_item: np.ndarray, load: np.ndarray, dissolved: np.ndarray,
           capacity: int, use_pairs: bool) -> bool:
    """Fill each kept bin in turn from the pool, one best move at a time, until it is full or no move gains.

    A move is :func:`_best_single_move`, or (``use_pairs``, when that one leaves the bin short)
    :func:`_pair_swap`, which fills it exactly: the pool items it names take the place of the item
    swapped out (or join the bin), and that item joins the pool. Updates ``load``; returns whether
    any bin changed.
    """
    moved = False
    for b in range(dissolved.shape[0]):
        if dissolved[b]:
            continue
        free = capacity - load[b]
        while free > 0:
            gain, out, out_prev = _best_single_move(sizes, has_size, bin_head, next_item, b, free, capacity)
            pair = 0
            if gain < free and use_pairs:
                pair_out, pair_out_prev, pair = _pair_swap(sizes, pool_count, has_size, bin_head, next_item, b, free,
                                                           capacity)
                if pair > 0:
                    gain, out, out_prev = free, pair_out, pair_out_prev
            if gain <= 0:
                break
            if out < 0:
                item = _pool_pop(pool_head, pool_count, has_size, next_item, gain)
                _add_to_bin(bin_head, bin_of, next_item, b, item)
            else:
                target = sizes[out] + gain
                item = _pool_pop(pool_head, pool_count, has_size, next_item, target if pair == 0 else pair)
                _replace_in_bin(bin_head, bin_of, next_item, b, out, out_prev, item)
                if pair > 0:
                    item = _pool_pop(pool_head, pool_count, has_size, next_item, target - pair)
                    _add_to_bin(bin_head, bin_of, next_item, b, item)
                bin_of[out] = -1
                _pool_push(pool_head, pool_count, has_size, next_item, sizes, out)
            free -= gain
            load[b] += gain
            moved = True
    return moved


@njit(cache=True)
def _pool_largest_first(pool_head: np.ndarray, pool_count: np.ndarray, next_item: np.ndarray) -> np.ndarray:
    """int64 ``[L]``: the items left in the pool, largest size first, each size's stack top first."""
    left = np.empty(pool_count.sum(), np.int64)
    k = 0
    for size in range(pool_head.shape[0] - 1, 0, -1):
        i = pool_head[size]
        while i >= 0:
            left[k] = i
            k += 1
            i = next_item[i]
    return left


@njit(cache=True)
def _merge_bins(bin_of: np.ndarray, dissolved: np.ndarray, left: np.ndarray, new_bins: np.ndarray,
                num_new: int) -> tuple[np.ndarray, int]:
    """``bin_of`` completed: the kept bins renumbered in their order, then ``new_bins`` of the ``left`` items."""
    renumber = np.empty(dissolved.shape[0], np.int64)
    num_kept = 0
    for b in range(dissolved.shape[0]):
        renumber[b] = num_kept
        num_kept += not dissolved[b]
    for i in range(bin_of.shape[0]):
        if bin_of[i] >= 0:
            bin_of[i] = renumber[bin_of[i]]
    for k in range(left.shape[0]):
        bin_of[left[k]] = num_kept + new_bins[k]
    return bin_of, num_kept + num_new


@njit(cache=True)
def _refill_round(sizes: np.ndarray, bins: np.ndarray, num_bins: int, capacity: int, num_pool: int,
                  offset: int, use_pairs: bool) -> tuple[np.ndarray, int]:
    """One round of the gap-closing pass; see :func:`_close_gaps`.

    Dissolves ``num_pool`` bins (:func:`_dissolved_bins`, which depend on ``offset``) into a pool of
    loose items. Then, up to :data:`_REFILL_SWEEPS` times over the other bins, each bin with free
    space ``r`` takes the move that fills most of ``r``: add the largest pool item ``<= r``, or swap
    one of its items ``y`` for the largest pool item ``<= y + r`` (``y`` joins the pool), or
    (``use_pairs``, first sweep only, when neither fills ``r`` exactly) swap ``y`` for two pool
    items summing to ``y + r``. What is left in the pool is packed best-fit decreasing into new
    bins. Returns the new ``bins`` (kept bins in their order, then the new ones) and their count.
    """
    load = _bin_loads(sizes, bins, num_bins)
    dissolved = _dissolved_bins(num_bins, num_pool, offset)
    pool_head, pool_count, has_size, bin_head, bin_of, next_item = _split_items(sizes, bins, dissolved, capacity)
    for sweep in range(_REFILL_SWEEPS):
        if not _sweep(sizes, pool_head, pool_count, has_size, bin_head, bin_of, next_item, load, dissolved, capacity,
                      use_pairs and sweep == 0):
            break
    left = _pool_largest_first(pool_head, pool_count, next_item)
    new_bins, num_new = _best_fit(sizes[left], capacity)
    return _merge_bins(bin_of, dissolved, left, new_bins, num_new)


@njit(cache=True)
def _close_gaps(sizes: np.ndarray, bins: np.ndarray, num_bins: int, capacity: int) -> tuple[np.ndarray, int]:
    """Gap-closing repair pass run after a greedy packing: fewer bins, or the same ``bins`` unchanged.

    Up to :data:`_REFILL_ROUNDS` rounds of :func:`_refill_round`, each dissolving
    ``min(8 * gap + 32, num_bins // 8)`` bins (at least one; ``gap``: bins above
    ``ceil(sum(sizes) / capacity)``) into a pool that refills the free space of the others. A
    round's result is kept only if it has fewer bins, so a pass that closes nothing returns the
    greedy packing as it was. Rounds use single-item moves until one fails, then also pair moves
    (first sweep only); the pass stops when a round with pair moves fails or the bound is reached.
    Deterministic: depends only on ``sizes`` (in the order given) and ``bins``.
    """
    lower_bound = (sizes.sum() + capacity - 1) // capacity
    use_pairs = False
    for attempt in range(_REFILL_ROUNDS):
        if num_bins <= lower_bound:
            break
        num_pool = max(min(8 * (num_bins - lower_bound) + 32, num_bins // 8), 1)
        new_bins, num_new = _refill_round(sizes, bins, num_bins, capacity, num_pool, attempt, use_pairs)
        if num_new < num_bins:
            bins, num_bins = new_bins, num_new
        elif use_pairs:
            break
        else:
            use_pairs = True
    return bins, num_bins


@njit(cache=True)
def _first_fit(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Each item, in the order given, goes to the lowest-numbered bin with room for it.

    A max-tree holds the free space of bins ``0..M-1``; bins not opened yet read as ``capacity``, so
    the leftmost bin with room is either an open bin or the next one to open.
    """
    num_items = sizes.shape[0]
    bins = np.empty(num_items, np.int64)
    leaves = _tree_leaves(max(num_items, 1))
    free = np.full(2 * leaves, capacity, np.int64)
    num_bins = 0
    for k in range(num_items):
        size = sizes[k]
        node = 1
        while node < leaves:
            node = 2 * node if free[2 * node] >= size else 2 * node + 1
        b = node - leaves
        bins[k] = b
        num_bins = max(num_bins, b + 1)
        free[node] -= size
        node >>= 1
        while node >= 1:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node >>= 1
    return bins, num_bins


@njit(cache=True)
def _next_fit(sizes: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Items, in the order given, fill the current bin; one that does not fit closes it and opens the next."""
    bins = np.empty(sizes.shape[0], np.int64)
    b = -1
    free = 0
    for k in range(sizes.shape[0]):
        if sizes[k] > free:
            b += 1
            free = capacity
        bins[k] = b
        free -= sizes[k]
    return bins, b + 1


@njit(cache=True)
def _exact_completion(counts: np.ndarray, room: int, largest: int, budget: int) -> tuple[int, int, int]:
    """Up to three remaining sizes ``a >= b >= c`` (each ``<= largest``, 0 = unused) summing to ``room``.

    ``counts[s]`` is the number of remaining items of size ``s``. Tries one item, then pairs, then
    triples, largest first; gives up with ``(0, 0, 0)`` after ``budget`` probes.
    """
    if room <= largest and counts[room] > 0:
        return room, 0, 0
    probes = 0
    for a in range(min(largest, room - 1), (room + 1) // 2 - 1, -1):
        probes += 1
        if counts[a] >= (2 if 2 * a == room else 1) and counts[room - a] > 0:
            return a, room - a, 0
    for a in range(min(largest, room - 2), (room + 2) // 3 - 1, -1):
        if probes >= budget:
            break
        if counts[a] == 0:
            probes += 1
            continue
        counts[a] -= 1
        rest = room - a
        for b in range(min(a, rest - 1), (rest + 1) // 2 - 1, -1):
            probes += 1
            if counts[b] >= (2 if 2 * b == rest else 1) and counts[rest - b] > 0:
                counts[a] += 1
                return a, b, rest - b
            if probes >= budget:
                break
        counts[a] += 1
    return 0, 0, 0


@njit(cache=True)
def _knapsack(sizes: np.ndarray, order: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Fill one bin at a time, opened with the largest remaining item; then add the largest remaining
    item that fits, unless at most three remaining items fill the bin exactly (then those, and the
    bin closes). A bin also closes when nothing fits.

    Items are bucketed by size (each bucket in ``order``, a slice of the items sorted by
    decreasing size); a presence tree over sizes finds the
    largest non-empty bucket ``<= free`` in O(log C); the exact-fill search costs at most
    O(C) probes and runs only when three items could fill the bin.
    """
    num_items = order.shape[0]
    by_size = _sort_descending(sizes, order, capacity)
    bin_at = np.empty(num_items, np.int64)
    counts = np.zeros(capacity + 1, np.int64)
    for size in sizes:
        counts[size] += 1
    next_of_size = np.zeros(capacity + 1, np.int64)
    for size in range(capacity - 1, 0, -1):
        next_of_size[size] = next_of_size[size + 1] + counts[size + 1]
    leaves = _tree_leaves(capacity + 1)
    has_item = np.zeros(2 * leaves, np.bool_)
    for size in range(1, capacity + 1):
        if counts[size] > 0:
            _set_presence(has_item, leaves, size, True)
    b = -1
    placed = 0
    while placed < num_items:
        b += 1
        free = capacity
        while free > 0:
            largest = _last_present_at_or_below(has_item, leaves, free)
            if largest < 1:
                break
            first, second, third = 0, 0, 0
            if free < capacity and free <= 3 * largest:
                first, second, third = _exact_completion(counts, free, largest, capacity)
            if first == 0:
                first = largest
            for size in (first, second, third):
                if size == 0:
                    continue
                bin_at[next_of_size[size]] = b
                next_of_size[size] += 1
                counts[size] -= 1
                if counts[size] == 0:
                    _set_presence(has_item, leaves, size, False)
                free -= size
                placed += 1
    bin_of_item = np.empty(num_items, np.int64)
    bin_of_item[by_size] = bin_at
    return bin_of_item, b + 1


_REPAIRED = frozenset({"bfd", "ffd"})
"""Strategies whose greedy packing is followed by the gap-closing pass (:func:`_close_gaps`)."""

_ONLINE_KERNELS = {"bfd": _best_fit, "ffd": _first_fit, "first_fit": _first_fit, "next_fit": _next_fit}


def assign_bins(sizes: np.ndarray, capacity: int, strategy: str, order: np.ndarray) -> tuple[np.ndarray, int]:
    """Run one strategy.

    Args:
        sizes: int64 ``[M]``, every entry in ``1..capacity`` (validated by the caller).
        capacity: bin size in tokens.
        strategy: one of :data:`STRATEGIES`.
        order: int64 ``[M]`` permutation; the order items are considered in (``first_fit``,
            ``next_fit``) or the tie-break between equal sizes (the other strategies).

    Returns:
        ``bin_of_item`` int64 ``[M]`` (bins numbered in opening order) and the number of bins.
    """
    if strategy == "knapsack":
        bin_of_item, num_bins = _knapsack(sizes, order, capacity)
        return bin_of_item, int(num_bins)
    considered = order if strategy in ORDER_KEEPING else _sort_descending(sizes, order, capacity)
    considered_sizes = sizes[considered]
    bins, num_bins = _ONLINE_KERNELS[strategy](considered_sizes, capacity)
    if strategy in _REPAIRED:
        bins, num_bins = _close_gaps(considered_sizes, bins, num_bins, capacity)
    bin_of_item = np.empty_like(bins)
    bin_of_item[considered] = bins
    return bin_of_item, int(num_bins)


@njit(cache=True)
def group_by_bin(bin_of_item: np.ndarray, bin_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Items grouped bin after bin, CSR style (a counting sort: O(M + bins)).

    Args:
        bin_of_item: int64 ``[M]``, bin of each item.
        bin_rank: int64 ``[B]``, the position of each bin in the output.

    Returns:
        ``items`` int64 ``[M]`` (item ids, bins in ``bin_rank`` order, ascending item id within a
        bin) and ``offsets`` int64 ``[B+1]`` (bin at position ``p`` holds
        ``items[offsets[p]:offsets[p + 1]]``).
    """
    num_bins = bin_rank.shape[0]
    offsets = np.zeros(num_bins + 1, np.int64)
    for b in bin_of_item:
        offsets[bin_rank[b] + 1] += 1
    for p in range(num_bins):
        offsets[p + 1] += offsets[p]
    cursor = offsets[:-1].copy()
    items = np.empty(bin_of_item.shape[0], np.int64)
    for i in range(bin_of_item.shape[0]):
        p = bin_rank[bin_of_item[i]]
        items[cursor[p]] = i
        cursor[p] += 1
    return items, offsets
