"""Indexed (DSA-style) sparse attention on a packed row: every query selects its keys from its own document only.

An indexer scores *candidates* (single keys, or pools of consecutive keys) for each query and keeps the top
``k``; attention then runs over the selected keys alone. On a packed row three things could cross a document
boundary, and each is cut here:

- pools: :func:`document_pools` cuts every document into complete pools of ``size`` tokens counted from the
  document's first token (a document alone pools from its token 0), never spanning two documents;
- top-k: :func:`document_topk` masks every candidate outside the query's document or after it (its last token
  must be visible) before ``topk``, and marks as ``-1`` the slots a query with fewer visible candidates than
  ``k`` cannot fill (``topk`` over at most the document's own visible candidates);
- attention: :func:`indexed_attention` attends only to selected keys in the query's document at or before it.

The incomplete pool a query sits in (its *tail*, :func:`visible_tail`) is counted from the document start too.
Selections are host-free (no tensor value is read on the host); sizes are Python ints from shapes.
"""

from __future__ import annotations

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError

__all__ = ["document_pools", "document_topk", "visible_tail", "indexed_attention"]


def _positions(boundaries: PackedBoundaries) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int64 ``[T]`` each: row position, segment id, and the position of the token's segment start."""
    segment = boundaries.seq_idx[0].long()
    starts = torch.as_tensor(boundaries.starts, dtype=torch.long, device=segment.device)
    return torch.arange(segment.shape[0], device=segment.device), segment, starts[segment]


def document_pools(boundaries: PackedBoundaries, size: int) -> torch.Tensor:
    """Complete pools of ``size`` consecutive tokens, each inside one segment, counted from the segment's start.

    Returns:
        int64 ``[P, size]``: the row positions of every pool's tokens, pools in row order. A segment of ``n``
        tokens holds ``n // size`` pools; its last ``n % size`` tokens are in none (they are tails).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InputError(f"size: expected a positive int (tokens per pool), got {size!r}")
    device = boundaries.device
    firsts = [start + size * p for start, length in zip(boundaries.starts, boundaries.segment_lengths)
              for p in range(length // size)]
    first = torch.as_tensor(firsts, dtype=torch.long, device=device).reshape(-1, 1)
    return first + torch.arange(size, device=device)


def document_topk(scores: torch.Tensor, candidate_last: torch.Tensor, boundaries: PackedBoundaries, k: int
                  ) -> torch.Tensor:
    """The ``k`` best candidates of each query among those of its own document whose last token it sees.

    Args:
        scores: ``[1, T, C]`` float: the indexer's score of candidate ``c`` for query ``t``.
        candidate_last: int ``[C]``: the row position of each candidate's last token (``arange(T)`` for single
            keys; ``pools[:, -1]`` for :func:`document_pools`). Candidate ``c`` is visible to query ``t`` when
            that token is in ``t``'s segment and ``<= t``.
        boundaries: where the documents of the row start.
        k: candidates per query.

    Returns:
        int64 ``[1, T, min(k, C)]``: the visible candidates' indices by descending score (a score of ``-inf``
        included), ties to the earlier candidate; ``-1`` where the query sees fewer.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"k: expected a positive int (candidates per query), got {k!r}")
    if scores.dim() != 3 or scores.shape[:2] != (1, boundaries.total_tokens):
        raise InputError(f"scores: expected [1, {boundaries.total_tokens}, candidates], got {list(scores.shape)}")
    if candidate_last.shape != scores.shape[2:]:
        raise InputError(f"candidate_last: expected [{scores.shape[2]}] (one per candidate), got "
                         f"{list(candidate_last.shape)}")
    position, segment, _ = _positions(boundaries)
    last = candidate_last.long()
    visible = (segment[last][None, :] == segment[:, None]) & (last[None, :] <= position[:, None])  # [T, C]
    # A visible candidate scored -inf ranks at the dtype's lowest finite value, above every invisible one (-inf):
    # the same choice packed as alone. A stable sort breaks ties toward the earlier candidate (topk's order is
    # unspecified).
    keyed = torch.where(visible, scores[0].clamp(min=torch.finfo(scores.dtype).min), float("-inf"))
    chosen = keyed.sort(dim=-1, descending=True, stable=True).indices[:, :min(k, scores.shape[2])]
    return chosen.masked_fill(~visible.gather(-1, chosen), -1)[None]


def visible_tail(boundaries: PackedBoundaries, size: int) -> torch.Tensor:
    """The tokens of each query's incomplete pool: those after its segment's last complete pool up to itself.

    Returns:
        int64 ``[1, T, size - 1]``: row positions, ascending; ``-1`` past the tail's length. Query ``t`` at
        offset ``o`` in its segment has a tail of ``(o + 1) % size`` tokens, ending at ``t``.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InputError(f"size: expected a positive int (tokens per pool), got {size!r}")
    position, _, start = _positions(boundaries)
    count = (position - start + 1) % size                                   # [T]
    offsets = torch.arange(size - 1, device=position.device)
    tail = (position - count + 1)[:, None] + offsets                        # [T, size - 1]
    return tail.masked_fill(offsets[None, :] >= count[:, None], -1)[None]


def indexed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                      boundaries: PackedBoundaries, *, softmax_scale: float | None = None) -> torch.Tensor:
    """Softmax attention of every query over its selected keys, within its own document.

    Args:
        q: ``[1, T, H, D]``.
        k: ``[1, T, Hkv, D]``; v: ``[1, T, Hkv, Dv]`` with ``H % Hkv == 0`` (query head ``h`` uses key/value head
            ``h // (H // Hkv)``).
        indices: int ``[1, T, S]``: row positions of the keys each query selected, shared by all heads, distinct
            per query; ``-1`` for none. A selected key outside the query's document, or after it, is not attended
            (the isolation guarantee: no selection ever reaches another document).
        boundaries: where the documents of the row start.
        softmax_scale: defaults to ``D ** -0.5``.

    Returns:
        ``[1, T, H, Dv]`` in q's dtype; a query with no selected key gets zeros.
    """
    _check(q, k, v, indices, boundaries)
    num_tokens, num_heads, head_dim = q.shape[1:]
    kv_heads = k.shape[2]
    scale = head_dim ** -0.5 if softmax_scale is None else float(softmax_scale)
    position, segment, _ = _positions(boundaries)
    chosen = indices[0].long()
    safe = chosen.clamp(0, num_tokens - 1)
    valid = (chosen == safe) & (segment[safe] == segment[:, None]) & (chosen <= position[:, None])   # [T, S]
    keys, values = k[0][safe], v[0][safe]                                   # [T, S, Hkv, D], [T, S, Hkv, Dv]
    grouped = q[0].reshape(num_tokens, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.einsum("tkgd,tskd->tkgs", grouped, keys) * scale         # [T, Hkv, G, S]
    selected = valid[:, None, None, :]
    any_selected = valid.any(-1)[:, None, None, None]
    # A query with no selected key softmaxes zeros instead of only -inf (no NaN, forward or backward), then drops it.
    scores = torch.where(any_selected, scores.masked_fill(~selected, float("-inf")), torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1) * any_selected
    out = torch.einsum("tkgs,tskd->tkgd", probs, values)
    return out.reshape(1, num_tokens, num_heads, v.shape[-1]).to(q.dtype)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
           boundaries: PackedBoundaries) -> None:
    """Raise :class:`InputError` naming the first argument :func:`indexed_attention` cannot take."""
    total = boundaries.total_tokens
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4 or x.shape[:2] != (1, total):
            raise InputError(f"{name}: expected [1, {total}, heads, head_dim], got {list(x.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise InputError(f"k: head dim {k.shape[-1]} must equal q's {q.shape[-1]}")
    if v.shape[2] != k.shape[2]:
        raise InputError(f"v: {v.shape[2]} heads must equal k's {k.shape[2]}")
    if q.shape[2] % k.shape[2]:
        raise InputError(f"k: {k.shape[2]} key/value heads must divide q's {q.shape[2]} heads")
    if indices.dim() != 3 or indices.shape[:2] != (1, total) or indices.is_floating_point():
        raise InputError(f"indices: expected int [1, {total}, selected], got {indices.dtype} {list(indices.shape)}")
