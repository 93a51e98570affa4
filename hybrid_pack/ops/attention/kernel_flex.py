"""torch flex attention adapter: a document mask over a row padded to a static, block-aligned length.

``torch.compile(flex_attention)`` compiles one kernel per input shape; a packed row's length changes
from batch to batch, and a symbolic (dynamic) length is what failed to find a kernel configuration
on an H100. So the row is padded to a *bucket*: the next power of two of at least one 128-token
block. A handful of buckets covers every length, each compiled once with ``dynamic=False`` (with
room for a few dozen compiled variants: buckets, dtypes, grad modes, instead of dynamo's 8). Each
128-token block of the padding is a segment of its own, so the padding costs one block of work per
block and no real token ever sees it; its outputs are dropped.

The block mask is built on the host from the segment lengths (which 128-token blocks of queries
meet which blocks of keys, and which of those lie wholly inside one document) and kept on the
:class:`PackedBoundaries` it belongs to: no dense ``[T, T]`` mask is ever built, and blocks that
straddle no document are skipped. ``mask_mod`` (same segment, and causal) refines the partial blocks.
A sliding window also skips the key blocks wholly before it (``mask_mod`` adds ``q_idx - kv_idx < window``).
On CPU flex attention runs eagerly (it materialises the scores: a check, not a fast path).

:data:`PARTIAL` is its form for context-parallel attention (:mod:`hybrid_pack.ops.attention.partial`): one
document's queries over more keys, causal with the diagonal bottom right (an offset mask ``Tk - Tq + q_idx >=
kv_idx``) or over earlier keys all seen (no mask), returning its log-sum-exp (differentiable) beside the output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.attention.partial import from_differentiable

__all__ = ["varlen_attention", "document_block_mask", "bucket_length", "padded_segment_ids", "BLOCK", "PARTIAL"]

BLOCK = 128  # the block mask's granularity, a multiple of every kernel tile flex attention picks


def bucket_length(total_tokens: int) -> int:
    """The static length a row of ``total_tokens`` is padded to: a power of two, at least one block."""
    return max(BLOCK, 1 << (total_tokens - 1).bit_length())


def padded_segment_ids(segment_lengths: tuple[int, ...], length: int) -> np.ndarray:
    """int64 ``[length]``: each token's segment, the bucket padding split into one segment per 128-token block
    (so a padding token attends only inside its block)."""
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    total = int(lengths.sum())
    padding = lengths.size + np.arange(total, length) // BLOCK
    return np.concatenate([np.repeat(np.arange(lengths.size), lengths), padding])


def _block_tables(segment_lengths: tuple[int, ...], length: int, causal: bool, window: int | None = None
                  ) -> tuple[np.ndarray, ...]:
    """``(partial_counts, partial_indices, full_counts, full_indices)`` of the block mask, as numpy.

    Query block ``i`` meets key block ``j`` when some token of ``i`` and some token of ``j`` share a segment
    (and ``j <= i`` when causal, and some pair lies less than ``window`` apart); the pair is *full* when both
    blocks lie in one segment and, causal, ``j < i`` (and every pair lies less than ``window`` apart).
    """
    segment = padded_segment_ids(segment_lengths, length)
    blocks = length // BLOCK
    first, last = segment[::BLOCK], segment[BLOCK - 1::BLOCK]
    meet = (first[None, :] <= last[:, None]) & (first[:, None] <= last[None, :])
    full = meet & (first == last)[:, None] & (first == last)[None, :]
    if causal:
        below = np.tril(np.ones((blocks, blocks), dtype=bool))
        meet &= below
        full &= np.tril(below, -1)
    if window is not None:
        gap = np.arange(blocks)[:, None] - np.arange(blocks)[None, :]  # i - j, in blocks
        meet &= (gap - 1) * BLOCK + 1 < window                          # the nearest pair of tokens
        full &= (gap + 1) * BLOCK - 1 < window                          # the farthest pair of tokens
    partial = meet & ~full

    def table(selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(~selected, axis=1, kind="stable")  # selected key blocks first, in order
        return selected.sum(1).astype(np.int32), order.astype(np.int32)

    return (*table(partial), *table(full))


def document_block_mask(boundaries: PackedBoundaries, causal: bool, window: int | None = None) -> BlockMask:
    """The block mask keeping every token of the bucket-padded row inside its own segment, and causal within
    ``window`` when one is given (kept on ``boundaries``)."""
    length = bucket_length(boundaries.total_tokens)

    def build() -> BlockMask:
        device = boundaries.device
        seq_idx = torch.from_numpy(padded_segment_ids(boundaries.segment_lengths, length)).to(device,
                                                                                           non_blocking=True)

        def same_segment(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            keep = seq_idx[q_idx] == seq_idx[kv_idx]
            if window is not None:
                return keep & (q_idx >= kv_idx) & (q_idx - kv_idx < window)
            return keep & (q_idx >= kv_idx) if causal else keep

        tables = [torch.from_numpy(t)[None, None].to(device, non_blocking=True)
                  for t in _block_tables(boundaries.segment_lengths, length, causal, window)]
        return BlockMask.from_kv_blocks(*tables, BLOCK_SIZE=BLOCK, mask_mod=same_segment, seq_lengths=(length, length))

    return boundaries.view(("flex_block_mask", causal, length, window), build)


RECOMPILE_LIMIT = 64  # compiled variants of flex_attention kept (dynamo's default, 8, falls back to dense eagerly)


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    compiled = torch.compile(flex_attention, dynamic=False)

    def attend(*args: Any, **kwargs: Any) -> torch.Tensor:
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)

    return attend


def _attend(device: torch.device) -> Callable[..., torch.Tensor]:
    """The compiled kernel on CUDA; eager flex attention elsewhere."""
    return _compiled_flex_attention() if device.type == "cuda" else flex_attention


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                     causal: bool, softmax_scale: float, window: int | None = None) -> torch.Tensor:
    """:func:`hybrid_pack.ops.varlen_attention` through ``flex_attention(block_mask=document mask)``."""
    total = boundaries.total_tokens
    pad = bucket_length(total) - total
    attend = _attend(q.device)
    q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(1, 2) for t in (q, k, v))
    out = attend(q, k, v, block_mask=document_block_mask(boundaries, causal, window), scale=softmax_scale,
                 enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)[:, :total]


def attend_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One document's queries ``q [Tq, H, D]`` over keys ``k, v [Tk, Hkv, D]``: causal bottom right (the queries
    are the last ``Tq`` positions; ``window`` keys each at most) or, not causal, every key seen.

    Returns:
        ``(out [Tq, H, D] in q's dtype, lse [Tq, H])``, both differentiable.
    """
    num_queries, num_keys = q.shape[0], k.shape[0]
    mask = None
    if causal:
        offset = num_keys - num_queries

        def bottom_right(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
                         ) -> torch.Tensor:
            distance = q_idx + offset - kv_idx
            return (distance >= 0) & (distance < window) if window is not None else distance >= 0

        mask = create_block_mask(bottom_right, None, None, num_queries, num_keys, device=q.device,
                                 _compile=q.device.type == "cuda")
    out, aux = _attend(q.device)(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                 block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                 return_aux=AuxRequest(lse=True))
    return out[0].transpose(0, 1), aux.lse[0].transpose(0, 1)


PARTIAL = from_differentiable("flex", attend_part)
