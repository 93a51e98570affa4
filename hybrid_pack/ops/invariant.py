"""Batch-invariant packing: every document's outputs bitwise independent of its row-mates (docs/api.md §7d).

Inside :func:`batch_invariant`, every sequence-mixing op computes each segment of a row in its canonical form: the
segment's ``L`` tokens gathered to the front of a zero-filled row of :func:`canonical_length` ``(L)`` tokens (``L``
rounded up to a multiple of :data:`CANONICAL_MULTIPLE`), the op's pure-torch backend run on that row (the segment,
then one padding segment), and the segment's outputs scattered back. That call's inputs are the segment's own
tokens and zeros, its shape a function of ``L`` alone, so its outputs are the same bits wherever the segment sits,
whatever it is packed with and whatever the row's length, and equal to the segment alone. Token-wise layers
(linears, norms, MLPs, the output head) need nothing on a row of fixed length: the rows of a CPU GEMM do not
depend on their neighbours (tests/test_batch_invariant.py checks it); MoE experts need transformers'
``batched_mm`` (the trainers set it). The cost is one op call per segment instead of one per row, each over
about its own length.

The mode is a context variable: it holds for the thread (or task) that entered it, never for another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import UnsupportedModelError

__all__ = ["batch_invariant", "is_batch_invariant", "refuse_in_batch_invariant_mode", "per_document",
           "canonical_length", "CANONICAL_MULTIPLE", "SEQUENCE_MIXING"]

_active: ContextVar[bool] = ContextVar("hybrid_pack_batch_invariant", default=False)

# op -> its per-token arguments ([1, T, ...]); every other argument is per row (weights) or per document (states).
SEQUENCE_MIXING: Mapping[str, tuple[str, ...]] = {
    "attention": ("q", "k", "v"),
    "conv": ("x",),
    "gated_delta": ("q", "k", "v", "g", "beta"),
    "kda": ("q", "k", "v", "g", "beta"),
    "decay_linear_attention": ("q", "k", "v", "g"),
    "ssd": ("x", "dt", "B", "C", "z"),
    "selective_scan": ("x", "dt", "B", "C", "z"),
}

# op -> (its initial-state argument [N, ...], the flag asking for final states [N, ...] as the second output).
_STATES: Mapping[str, tuple[str, str]] = {
    "gated_delta": ("initial_state", "output_final_state"),
    "kda": ("initial_state", "output_final_state"),
    "decay_linear_attention": ("initial_state", "output_final_state"),
    "ssd": ("initial_states", "return_final_states"),
}


@contextlib.contextmanager
def batch_invariant() -> Iterator[None]:
    """Inside the block, packed rows of a fixed length give every sequence bitwise the same outputs whatever it
    is packed with and wherever it sits, equal to the sequence alone in a row of that length.

    Sequence-mixing ops run on their pure-torch backends, one canonical call per segment (module docstring);
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


@torch.compiler.assume_constant_result
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
"""A segment's canonical row is its length rounded up to a multiple of this (every chunked op's grid then starts at
the segment's first token, and the row's shape depends on the segment alone)."""


def canonical_length(length: int) -> int:
    """The length of the canonical row of a segment of ``length`` tokens."""
    return -(-length // CANONICAL_MULTIPLE) * CANONICAL_MULTIPLE


def _canonical_rows(boundaries: PackedBoundaries) -> list[PackedBoundaries]:
    """For every segment of the row, the boundaries of its canonical row: the segment, then padding up to
    :func:`canonical_length`."""

    def build() -> list[PackedBoundaries]:
        return [PackedBoundaries.from_document_lengths([length], num_pad_tokens=canonical_length(length) - length,
                                                       device=boundaries.device)
                for length in boundaries.segment_lengths]

    return boundaries.view(("batch_invariant", "canonical_rows"), build)


def _to_front(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """``x [1, T, ...]``: tokens ``start:start + length``, then zeros up to :func:`canonical_length`."""
    piece = x[:, start:start + length]
    return torch.cat([piece, piece.new_zeros(1, canonical_length(length) - length, *x.shape[2:])], dim=1)


def per_document(op: str, fn: Callable[..., Any], positional: tuple[str, ...], arguments: Mapping[str, Any],
                 boundaries: PackedBoundaries) -> Any:
    """Run ``fn`` (a whole-row backend of ``op``) once per segment of the row, in the segment's canonical row.

    Args:
        op: a key of :data:`SEQUENCE_MIXING`.
        fn: ``fn(*positional tensors, boundaries, **keywords)``, as the route calls a backend.
        positional: the names passed before the boundaries.
        arguments: the call's arguments by name (per-token tensors ``[1, T, ...]``, states ``[N, ...]``).
        boundaries: the row.

    Returns:
        What ``fn`` returns for the whole row: per-token outputs ``[1, T, ...]`` put together from the segments'
        canonical calls, and the documents' final states ``[N, ...]`` when asked for.
    """
    tokens = SEQUENCE_MIXING[op]
    state_name, final_flag = _STATES.get(op, ("", ""))
    initial = arguments.get(state_name)
    wants_states = bool(arguments.get(final_flag, False))
    outputs, states = [], []
    for segment, (start, length, row) in enumerate(zip(boundaries.starts, boundaries.segment_lengths,
                                                       _canonical_rows(boundaries), strict=True)):
        call = {name: _to_front(value, start, length) if name in tokens and value is not None else value
                for name, value in arguments.items()}
        if initial is not None:
            call[state_name] = (initial[segment:segment + 1] if segment < boundaries.num_docs
                                else initial.new_zeros(1, *initial.shape[1:]))
        keywords = {name: value for name, value in call.items() if name not in positional}
        result = fn(*(call[name] for name in positional), row, **keywords)
        if isinstance(result, tuple):
            outputs.append(result[0][:, :length])
            if wants_states and segment < boundaries.num_docs:
                states.append(result[1][:1])
        else:
            outputs.append(result[:, :length])
    out = torch.cat(outputs, dim=1)
    if not state_name:
        return out
    final = torch.cat(states) if wants_states else None
    return (out, final) if op != "ssd" or wants_states else out
