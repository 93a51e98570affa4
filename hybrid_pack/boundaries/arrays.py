"""The host arrays of a packed row's boundaries, from its segment lengths, in one compiled pass."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["boundary_arrays"]


def boundary_arrays(segment_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``cu_seqlens`` int32 ``[S + 1]``, ``seq_idx`` int32 ``[1, T]`` and restarting ``position_ids``
    int64 ``[1, T]`` of consecutive segments with these lengths (int64 ``[S]``, each >= 1)."""
    return _fill(segment_lengths, int(segment_lengths.sum()))


@njit(cache=True)
def _fill(lengths: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One compiled pass: half the time of the equivalent NumPy cumsum / repeat calls (their call overhead)."""
    cu_seqlens = np.empty(lengths.size + 1, dtype=np.int32)
    seq_idx = np.empty((1, total), dtype=np.int32)
    position_ids = np.empty((1, total), dtype=np.int64)
    cu_seqlens[0] = 0
    token = 0
    for segment in range(lengths.size):
        for position in range(lengths[segment]):
            seq_idx[0, token] = segment
            position_ids[0, token] = position
            token += 1
        cu_seqlens[segment + 1] = token
    return cu_seqlens, seq_idx, position_ids
