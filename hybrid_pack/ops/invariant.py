"""Batch-invariant packing: every document's outputs bitwise independent of its row-mates (docs/api.md §7e).

Inside :func:`batch_invariant`, every sequence-mixing op runs on its pure-torch backend, whose arithmetic on one
segment is the same whatever else the row holds:

- the chunked scans (``gated_delta``, ``kda``, ``decay_linear_attention``, ``ssd``) cut every segment into chunks
  that start at its first token (:meth:`PackedBoundaries.chunk_layout`) and compute each chunk, and each segment's
  step of the scan over chunks, as one member of a batched product; ``selective_scan`` steps token by token;
  ``conv`` masks its taps per token. A batched product's member does not depend on the batch's size or on the
  member's place in it (tests/test_batch_invariant.py checks it), so these run once on the whole row, as outside
  the mode;
- ``attention`` batches segments into padded buckets; outside the mode a bucket's length (the padded key length,
  which sets the softmax's reduction) is its longest member's, so it depends on the row-mates. Inside the mode
  every segment of ``L`` tokens runs in a bucket of :func:`canonical_length` ``(L)`` (``L`` rounded up to a
  multiple of :data:`CANONICAL_MULTIPLE`), its own row of the batch of all the row's segments of that canonical
  length (:func:`canonical_buckets`): its inputs are its own tokens and zeros, its shape a function of ``L``.

Token-wise layers (linears, norms, MLPs, the output head) need nothing on a row of fixed length: the rows of a
CPU GEMM do not depend on their neighbours (checked by the same tests); MoE experts need transformers'
``batched_mm`` (the trainers set it). The mode costs what the canonical attention buckets add: padding every
segment to a multiple of 64 tokens.

The mode is a context variable: it holds for the thread (or task) that entered it, never for another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import numpy as np
import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.buckets import Bucket, BucketLayout
from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.ops.compiler import assume_constant_result

__all__ = ["batch_invariant", "is_batch_invariant", "refuse_in_batch_invariant_mode", "per_document",
           "canonical_buckets", "canonical_length", "CANONICAL_MULTIPLE", "SEQUENCE_MIXING"]

_active: ContextVar[bool] = ContextVar("hybrid_pack_batch_invariant", default=False)

SEQUENCE_MIXING = frozenset({"attention", "conv", "gated_delta", "kda", "decay_linear_attention", "ssd",
                             "selective_scan"})
"""The ops that mix tokens along the row: inside the mode they run on their pure-torch backends
(:func:`per_document`)."""


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Inside the block, packed rows of a fixed length give every sequence bitwise the same outputs whatever it
    is packed with and wherever it sits, equal to the sequence alone in a row of that length.

    Sequence-mixing ops run on their pure-torch backends, attention in canonical buckets (module docstring);
    rows split across a context-parallel group and compiled static rows are refused (:class:`InputError`).
    """
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)


def is_batch_invariant() -> bool:
    """Whether this thread (or task) is inside :func:`batch_invariant`. Under ``torch.compile`` the value at trace
    time is baked into the graph (dynamo cannot trace a ``ContextVar``): tracing inside the mode meets its refusal of
    compiled rows; a graph traced outside the mode keeps the default path when later called inside it."""
    if torch.compiler.is_compiling():
        return _traced_flag()
    return _active.get()


inside_batch_invariant = _active.get
""":func:`is_batch_invariant` for a caller that knows it runs eagerly (one ``ContextVar`` read)."""


@assume_constant_result  # hybrid_pack.ops.compiler: torch._dynamo is not imported with the ops
def _traced_flag() -> bool:
    return _active.get()


def refuse_in_batch_invariant_mode(layer: str, kind: str) -> None:
    """Raise :class:`UnsupportedModelError` inside :func:`batch_invariant` for a layer whose packed forward has no
    batch-invariant form (it does not run on the routed §4 ops), so a run that asked for bitwise log-probs never
    gets them silently."""
    if is_batch_invariant():
        raise UnsupportedModelError(f"{layer}: {kind} has no batch-invariant form; run this model outside "
                                    "hybrid_pack.batch_invariant() (batch_invariant=False)")


CANONICAL_MULTIPLE = 64
"""A segment's canonical attention bucket is its length rounded up to a multiple of this (the bucket's shape then
depends on the segment alone)."""


def canonical_length(length: int) -> int:
    """The length of the canonical bucket of a segment of ``length`` tokens."""
    return -(-length // CANONICAL_MULTIPLE) * CANONICAL_MULTIPLE


def canonical_buckets(boundaries: PackedBoundaries) -> BucketLayout:
    """The row's segments (the padding segment included) in canonical attention buckets: one bucket per canonical
    length, holding every segment of that :func:`canonical_length` in row order, each right-padded with zeros;
    ``key_padding`` is always given, so a non-causal segment runs the same masked kernel whatever its row-mates.
    Built on the host once per boundaries object (every attention layer of a forward shares it)."""

    def build() -> BucketLayout:
        lengths = np.asarray(boundaries.segment_lengths, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        canonical = -(-lengths // CANONICAL_MULTIPLE) * CANONICAL_MULTIPLE
        slot_of_token = np.empty(int(lengths.sum()), dtype=np.int64)
        buckets, first_slot = [], 0
        for bucket_length in sorted({int(c) for c in canonical if c > 0}, reverse=True):
            members = np.flatnonzero(canonical == bucket_length)
            for row, segment in enumerate(members.tolist()):
                row_slot = first_slot + row * bucket_length
                slot_of_token[starts[segment]:starts[segment] + lengths[segment]] = np.arange(
                    row_slot, row_slot + lengths[segment])
            real = np.arange(bucket_length)[None, :] < lengths[members][:, None]
            key_padding = torch.from_numpy(real).view(len(members), 1, 1, bucket_length)
            buckets.append(Bucket(len(members), bucket_length, key_padding.to(boundaries.device, non_blocking=True)))
            first_slot += len(members) * bucket_length
        return BucketLayout(torch.from_numpy(slot_of_token).to(boundaries.device, non_blocking=True),
                            tuple(buckets), first_slot)

    return boundaries.view(("batch_invariant", "canonical_buckets"), build)


def per_document(op: str, fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...], options: Mapping[str, Any],
                 boundaries: PackedBoundaries) -> Any:
    """Run ``fn`` (``op``'s pure-torch backend) on the row so that every segment's outputs are computed as the
    segment's alone: attention in :func:`canonical_buckets`, the other ops of :data:`SEQUENCE_MIXING` as they are
    (module docstring).

    Args:
        op: one of :data:`SEQUENCE_MIXING`.
        fn: ``fn(*tensors, boundaries, **options)``, as the route calls a backend.
        tensors: the tensors passed before the boundaries (per-token ``[1, T, ...]``).
        options: the other arguments by name (states ``[N, ...]``, flags).
        boundaries: the row.

    Returns:
        What ``fn`` returns for the row.
    """
    if op == "attention":
        options = {**options, "buckets": canonical_buckets(boundaries)}
    return fn(*tensors, boundaries, **options)
