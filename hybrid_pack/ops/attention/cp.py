"""Causal attention on one rank's slice of a row split across a context-parallel group (docs/parallel.md).

Only the first segment of each of this rank's chunks can have earlier keys elsewhere (a document that
began before the chunk: on another rank, or on this one for the zigzag layout's later chunk). The rank
receives, before each chunk, that document's earlier keys and values (both in one exchange,
:func:`~hybrid_pack.ops.cp.exchange.with_preceding_tokens`); the document's queries in the chunk attend
to ``[earlier, in the chunk]`` keys with the causal diagonal aligned to the bottom right (query ``i`` sees
keys ``<= halo + i``), blockwise with an online softmax
(:func:`~hybrid_pack.ops.attention.blockwise.lower_right_causal_attention`: never a ``[Tq, Tk]`` score or
mask). Every other local segment runs the single-device op (the selected backend) in one call. Keys' and
values' gradients go back to the tokens they came from. Serves every layout: under zigzag a rank's late
chunk (long halos) balances its early one. Elements received per rank: ``2 * Hkv * D`` per earlier token of
each chunk's continuing document.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.attention.blockwise import lower_right_causal_attention
from hybrid_pack.ops.cp.exchange import with_preceding_tokens

__all__ = ["varlen_attention_cp"]


def _other_segments(boundaries: ShardedBoundaries, halos: tuple[int, ...]) -> PackedBoundaries | None:
    """Plain boundaries of the local segments but each chunk's first where its halo is not empty, in order
    (None when there are none)."""
    def build() -> PackedBoundaries | None:
        lengths: list[int] = []
        for halo, segments in zip(halos, boundaries.chunk_segments, strict=True):
            lengths += segments[1:] if halo else segments
        if not lengths:
            return None
        padding = boundaries.local.num_pad_tokens and not (halos[-1] and len(boundaries.chunk_segments[-1]) == 1)
        return PackedBoundaries.from_lengths(lengths, device=boundaries.device,
                                             num_pad_tokens=lengths[-1] if padding else 0)

    return boundaries.view(("attention_other_segments", halos), build)


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
        window: sliding window (keys each query sees, itself included); the blockwise attention of a continuing
            document skips its received earlier keys that lie outside every local query's window.

    Returns:
        ``[1, T_local, H, D]``.
    """
    if not causal:
        raise InputError("causal: context-parallel attention is causal only (a bidirectional document split "
                         "across ranks would need keys from later ranks); run causal=False unsharded")
    boundaries.check_group()
    local = functools.partial(op, causal=True, softmax_scale=softmax_scale, window=window, backend=backend)
    # The exchange's output feeds every result, so every rank runs its backward (a collective).
    keys_values, halos = with_preceding_tokens(torch.stack([k[0], v[0]], dim=1), boundaries)
    if not any(halos):
        return local(q, keys_values[None, :, 0], keys_values[None, :, 1], boundaries.local)
    heads: list[torch.Tensor | None] = []
    other_queries, other_keys_values, other_lengths = [], [], []
    at_local = at_extended = 0
    for halo, segments, (_, length) in zip(halos, boundaries.chunk_segments, boundaries.chunks, strict=True):
        first = segments[0] if halo else 0
        if halo:
            head_kv = keys_values[at_extended:at_extended + halo + first]
            heads.append(lower_right_causal_attention(q[0, at_local:at_local + first], head_kv[:, 0], head_kv[:, 1],
                                                      scale=softmax_scale, window=window))
        else:
            heads.append(None)
        other_queries.append(q[0, at_local + first:at_local + length])
        other_keys_values.append(keys_values[at_extended + halo + first:at_extended + halo + length])
        other_lengths.append(length - first)
        at_local, at_extended = at_local + length, at_extended + halo + length
    rest = _other_segments(boundaries, halos)
    if rest is not None:
        others = torch.cat(other_keys_values)
        outputs = local(torch.cat(other_queries)[None], others[None, :, 0], others[None, :, 1], rest)[0]
        other_outputs = outputs.split(other_lengths)
    else:
        other_outputs = [q.new_empty(0, *q.shape[2:])] * len(heads)
    pieces = [piece for head, other in zip(heads, other_outputs, strict=True)
              for piece in ((other,) if head is None else (head, other))]
    return torch.cat(pieces)[None]
