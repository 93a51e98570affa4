"""Causal attention on one rank's slice of a row split across a context-parallel group (docs/parallel.md).

Only the first segment of each of this rank's chunks can have earlier keys elsewhere (a document that
began before the chunk: on another rank, or on this one for the zigzag layout's later chunk): the chunk's
*head*. Every other local segment runs the single-device op (the selected backend) in one call. The heads run
the selected backend's partial form (:mod:`hybrid_pack.ops.attention.partial`: flash-attn, flex, else the
blockwise oracle), causal with the diagonal bottom right:

- no window: ring passes over the document's earlier keys, one piece (an eighth of a chunk) at a time, merged by
  log-sum-exp, the next piece's exchange overlapping this one's compute (:mod:`hybrid_pack.ops.attention.ring`):
  a rank holds at most two pieces of others' keys and values, never the whole earlier document. The other
  segments take their ``q, k, v`` from the ring (views), so each tensor's gradient fills one buffer of the rank's
  size, not one per consumer;
- a sliding ``window``: a head sees at most ``window - 1`` earlier keys, fetched in one exchange
  (:func:`~hybrid_pack.ops.cp.exchange.with_preceding_tokens` with ``limit=window - 1``), then one bottom-right
  call over ``[those keys, its own]``.

Keys' and values' gradients go back to the ranks holding them. Serves every layout: under zigzag a rank's late
chunk (long heads) balances its early one. No copy of a whole output or gradient is made where a view serves
(``squeeze`` for the batch dimension, the ring's output itself for a rank of heads alone): per-rank peak memory
is ``O(T / R)``, about ``1 / R`` of the unsharded op's (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.attention.check import OP, signature_of
from hybrid_pack.ops.attention.partial import PartialAttention, attend, partial_attention_of
from hybrid_pack.ops.attention.ring import ring_attention, ring_plan
from hybrid_pack.ops.cp.exchange import with_preceding_tokens
from hybrid_pack.ops.dispatch import verdicts
from hybrid_pack.ops.dispatch.discovery import recording_keys
from hybrid_pack.ops.dispatch.selector import forced_context, resolve

__all__ = ["varlen_attention_cp"]

PARTIAL = "attention partial form"
"""The first item of a context-parallel attention call's key in :data:`verdicts.CHOICES`."""


def _other_segments(boundaries: ShardedBoundaries, halos: tuple[int, ...]) -> PackedBoundaries | None:
    """Plain boundaries of the local segments but each chunk's head (first segment where its halo is not empty), in
    order (None when there are none)."""
    def build() -> PackedBoundaries | None:
        lengths: list[int] = []
        for halo, segments in zip(halos, boundaries.chunk_segments, strict=True):
            lengths += segments[1:] if halo else segments
        if not lengths:
            return None
        padding = boundaries.local.num_pad_tokens and not (halos[-1] and len(boundaries.chunk_segments[-1]) == 1)
        return PackedBoundaries.from_lengths(lengths, device=boundaries.device,
                                             num_pad_tokens=lengths[-1] if padding else 0)

    return boundaries.view(("attention_other_segments", tuple(map(bool, halos))), build)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` joined along tokens (the one part itself, uncopied, when there is one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _rows(x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``x``: ``x`` itself when that is all of it (a slice's backward is a zero tensor
    of ``x``'s size)."""
    return x if start == 0 and stop == x.shape[0] else x[start:stop]


def _partial_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, window: int | None,
                  backend: str | None) -> PartialAttention:
    """The partial form of the backend the selector picks for this call on a whole row (the one the other
    segments run on): a kernel serves it only after its self-check, which covers these shapes. Chosen once per
    key, like a route's choice (:data:`verdicts.CHOICES`)."""
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    key = (PARTIAL, q.device, requires_grad, backend, forced_context().get(OP), q.shape[2:], k.shape[2],
           window, q.dtype, k.dtype, v.dtype)
    form = verdicts.CHOICES.get(key)
    if form is None:
        inputs = {"q": q, "k": k, "v": v, "causal": True, "softmax_scale": softmax_scale, "window": window,
                  "requires_grad": requires_grad}
        chosen = resolve(OP, device=q.device, dtype=q.dtype, requires_grad=requires_grad, backend=backend,
                         inputs=inputs, signature=signature_of(q, k, v, True, window))
        form = partial_attention_of(chosen.name)
        if not recording_keys():  # the discovery pass runs on the pure-torch backends: nothing to keep
            verdicts.CHOICES[key] = form
    return form


def varlen_attention_cp(op: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        boundaries: ShardedBoundaries, *, causal: bool, softmax_scale: float,
                        backend: str | None, window: int | None = None) -> torch.Tensor:
    """This rank's slice of :func:`hybrid_pack.ops.varlen_attention` over the whole row.

    Args:
        op: the public single-device op (called with plain boundaries and ``backend``).
        q: ``[1, T_local, H, D]``; k, v: ``[1, T_local, Hkv, D]`` (the same dtype), this rank's tokens (its
            chunks in order, any layout).
        boundaries: this rank's :class:`ShardedBoundaries` (a collective over its group).
        causal: must be True (a bidirectional document would also need its later tokens' keys).
        softmax_scale: multiplies ``q @ k^T``.
        window: sliding window (keys each query sees, itself included): a head fetches only the ``window - 1``
            keys before its chunk.

    Returns:
        ``[1, T_local, H, D]``.
    """
    if not causal:
        raise InputError("causal: context-parallel attention is causal only (a bidirectional document split "
                         "across ranks would need keys from later ranks); run causal=False unsharded")
    boundaries.check_group()
    local = functools.partial(op, causal=True, softmax_scale=softmax_scale, window=window, backend=backend)
    halos = boundaries.chunk_first_positions[boundaries.rank]
    plan = ring_plan(boundaries)
    if not plan.passes and not plan.heads and window is None:
        return local(q, k, v, boundaries.local)
    partial = _partial_form(q, k, v, softmax_scale, window, backend)
    # squeeze, not [0]: its backward is a view (a select's would copy every gradient).
    queries, keys, values = (t.squeeze(0) for t in (q, k, v))
    firsts = [segments[0] if halo else 0 for halo, segments in zip(halos, boundaries.chunk_segments, strict=True)]
    starts = [sum(length for _, length in boundaries.chunks[:i]) for i in range(len(halos))]
    others = [(at + first, at + length) for at, first, (_, length) in zip(starts, firsts, boundaries.chunks,
                                                                           strict=True)]
    if window is None:
        # Every rank runs the ring, forward and backward (its exchanges are collectives). The other segments take
        # their q, k, v from it, so each tensor's gradient fills one buffer.
        ring, other_parts = ring_attention(queries, keys, values, boundaries, partial=partial,
                                           scale=softmax_scale, others=others)
        heads = iter(ring.split([length for _, length in plan.heads]) if len(plan.heads) > 1 else (ring,))
        head_outputs = [next(heads) if halo else None for halo in halos]
    else:
        # The exchange's output feeds every result, so every rank runs its backward (a collective).
        extended, limits = with_preceding_tokens(torch.stack([keys, values], dim=1), boundaries, limit=window - 1)
        keys, values = extended[:, 0], extended[:, 1]
        head_outputs, other_parts = [], []
        for i, (halo, limit, at, first, (begin, end)) in enumerate(zip(halos, limits, starts, firsts, others,
                                                                        strict=True)):
            at_keys = at + sum(limits[:i]) + limit  # this chunk's first key, after its fetched ones
            span = slice(at_keys - limit, at_keys + first)
            head_outputs.append(attend(partial, queries[at:at + first], keys[span], values[span],
                                       scale=softmax_scale, causal=True, window=window) if halo else None)
            other_keys = (at_keys + begin - at, at_keys + end - at)
            other_parts.append((_rows(queries, begin, end), _rows(keys, *other_keys), _rows(values, *other_keys)))
    rest = _other_segments(boundaries, halos)
    if rest is not None:
        outputs = local(*(_joined(list(parts))[None] for parts in zip(*other_parts, strict=True)), rest).squeeze(0)
        other_outputs = outputs.split([end - begin for begin, end in others]) if len(others) > 1 else (outputs,)
    else:
        other_outputs = [q.new_empty(0, *q.shape[2:])] * len(halos)
    pieces = [piece for head, other in zip(head_outputs, other_outputs, strict=True)
              for piece in ((other,) if head is None else (head, other)) if piece.shape[0]]
    if window is None and len(pieces) == len(plan.heads):
        return ring[None]  # this rank's tokens are its heads alone: the ring's output, uncopied
    return _joined(pieces)[None]
