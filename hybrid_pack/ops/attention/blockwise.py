"""Causal attention with the diagonal aligned bottom right, computed block by block with an online softmax.

The queries are the last ``Tq`` of ``Tk`` positions (``Tk >= Tq``): query ``i`` sees keys
``j <= Tk - Tq + i``, as :func:`torch.nn.attention.bias.causal_lower_right` masks them. A sliding ``window`` keeps
only keys ``j > Tk - Tq + i - window`` too, and the key blocks wholly before it are skipped. Not causal
(:func:`attention_forward` / :func:`attention_backward` with ``causal=False``), every query sees every key: a
continuing document's queries over a piece of its earlier keys. These are the pure-torch partial form of
context-parallel attention (``ops/attention/partial.py``, ``ops/attention/ring.py``): the CPU oracle and the
fallback of every backend without a partial form of its own.

Forward walks query blocks and, for each, the key blocks up to its diagonal (the blocks entirely above it
are never touched), keeping a running row maximum and sum (float32; float64 for float64 inputs). It saves
only ``q, k, v``, the output and the per-row log-sum-exp. Backward recomputes each block's probabilities
from that log-sum-exp (or from a merged one: :func:`attention_backward`) and forms
``dS = P * (dP - rowsum(dO * O))`` (flash-attention 2), accumulating ``dq, dk, dv`` block by block. Beyond the
inputs, outputs and gradients, no tensor is larger than ``block * block * H`` elements: never a ``[Tq, Tk]``
score or mask. Grouped-query attention needs no repeated keys: a block's ``G = H / Hkv`` query heads per
key/value head are stacked as extra rows of one matrix product with that head's keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from hybrid_pack.errors import InputError

__all__ = ["lower_right_causal_attention", "lower_right_causal_attention_with_lse", "attention_forward",
           "attention_backward"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def lower_right_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                                 block: int = 512, window: int | None = None) -> torch.Tensor:
    """Softmax attention of the last ``Tq`` positions over all ``Tk``, causal with the diagonal bottom right.

    Args:
        q: ``[Tq, H, D]``.
        k, v: ``[Tk, Hkv, D]`` with ``Tk >= Tq`` and ``H % Hkv == 0``; query head ``h`` uses key/value head
            ``h // (H // Hkv)``. q, k and v share one dtype (float16, bfloat16, float32 or float64) and device.
        scale: multiplies ``q @ k^T`` before the softmax.
        block: query and key rows per block (peak extra memory is ``O(block^2 * H)``).
        window: sliding window: query ``i`` sees only keys ``0 <= Tk - Tq + i - j < window`` (None: no window).

    Returns:
        ``[Tq, H, D]`` in q's dtype: query ``i`` attends to keys ``j <= Tk - Tq + i``.
    """
    return lower_right_causal_attention_with_lse(q, k, v, scale=scale, block=block, window=window)[0]


def lower_right_causal_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                                          block: int = 512, window: int | None = None
                                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`lower_right_causal_attention` and each row's log-sum-exp of its scaled scores, both differentiable.

    The log-sum-exp lets a caller merge this result with attention over other keys:
    ``out = sum_i exp(lse_i - logsumexp_i(lse_i)) * out_i``.

    Returns:
        ``(out, lse)``: out ``[Tq, H, D]`` in q's dtype; lse ``[Tq, H]`` in float32 (float64 for float64 inputs).
    """
    _check(q, k, v, scale, block, window)
    return _LowerRightCausalAttention.apply(q, k, v, float(scale), int(block), window)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block: int, window: int | None
           ) -> None:
    """Raise :class:`InputError` naming the first argument this function cannot take."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise InputError(f"{name}: expected [tokens, heads, head_dim], got shape {list(x.shape)}")
        if x.dtype not in DTYPES:
            raise InputError(f"{name}: dtype {x.dtype} is not one of float16, bfloat16, float32, float64")
    if k.shape != v.shape:
        raise InputError(f"v: shape {list(v.shape)} must equal k's {list(k.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise InputError(f"q, k, v: one dtype expected, got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one")
    if not q.device == k.device == v.device:
        raise InputError(f"q, k, v: one device expected, got {q.device}, {k.device}, {v.device}")
    if q.shape[2] != k.shape[2]:
        raise InputError(f"k: head_dim {k.shape[2]} must equal q's {q.shape[2]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise InputError(f"k: {k.shape[1]} key/value heads must divide q's {q.shape[1]} heads")
    if k.shape[0] < q.shape[0]:
        raise InputError(f"k: {k.shape[0]} keys is fewer than q's {q.shape[0]} queries; the queries are the last "
                         "Tq of the Tk positions, so pass every earlier key too")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise InputError(f"scale: expected a finite number, got {scale!r}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise InputError(f"block: expected a positive int (rows per block, e.g. 512), got {block!r}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise InputError(f"window: expected None or a positive int (keys each query sees), got {window!r}")


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where scores, running maxima and sums live: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(x: torch.Tensor, start: int, stop: int, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[start, stop)`` of ``[T, H, ...]`` as ``[Hkv, G * (stop - start), ...]`` in ``dtype``.

    Query head ``h = g + G * j`` goes to key/value head ``j``; within it, rows are ``(g, position)``."""
    x = x[start:stop]
    x = x.reshape(x.shape[0], kv_heads, -1, *x.shape[2:]).movedim(0, 2)  # [Hkv, G, b, ...]
    return x.reshape(kv_heads, -1, *x.shape[3:]).to(dtype)


def _unrows(x: torch.Tensor, length: int) -> torch.Tensor:
    """The inverse of :func:`_rows`: ``[Hkv, G * length, ...]`` back to ``[length, H, ...]``."""
    x = x.reshape(x.shape[0], -1, length, *x.shape[2:]).movedim(2, 0)  # [length, Hkv, G, ...]
    return x.reshape(length, -1, *x.shape[3:])


def _key_blocks(start: int, stop: int, offset: int, block: int, device: torch.device, window: int | None,
                full: int | None = None) -> Iterator[tuple[int, int, torch.Tensor | None]]:
    """The key blocks queries ``[start, stop)`` see: ``(key_start, key_stop, mask)``.

    Keys run up to the last query's diagonal ``offset + stop - 1`` (and, with a window, from the first query's
    ``offset + start - window + 1``); blocks beyond are skipped. ``mask`` ``[stop - start, key_stop - key_start]``
    is True where a query does not see a key (above the diagonal, or ``window`` or more behind it), or None where
    every query sees every key of the block. ``full``: every query sees all ``full`` keys (not causal), unmasked."""
    if full is not None:
        for key_start in range(0, full, block):
            yield key_start, min(key_start + block, full), None
        return
    end = offset + stop
    low = 0 if window is None else max(0, offset + start - window + 1)
    queries = torch.arange(start + offset, end, device=device)
    for key_start in range(low - low % block, end, block):
        key_stop = min(key_start + block, end)
        above = key_stop - 1 > offset + start
        behind = window is not None and end - 1 - key_start >= window
        mask = None
        if above or behind:
            distance = queries[:, None] - torch.arange(key_start, key_stop, device=device)[None, :]
            mask = distance < 0 if window is None else (distance < 0) | (distance >= window)
        yield key_start, key_stop, mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, groups: int,
            shift: torch.Tensor | None = None) -> torch.Tensor:
    """``q @ k^T - shift`` ``[Hkv, G * b, bk]`` (q already scaled; shift ``[Hkv, G * b]`` per row), ``-inf`` above
    the diagonal."""
    if shift is None:
        scores = q @ k.transpose(1, 2)
    else:
        scores = torch.baddbmm(shift[..., None], q, k.transpose(1, 2), beta=-1)
    if mask is not None:
        scores.view(scores.shape[0], groups, -1, scores.shape[2]).masked_fill_(mask, float("-inf"))
    return scores


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool = True,
                      window: int | None = None, block: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The online-softmax forward, outside autograd: ``(out [Tq, H, D] in q's dtype, lse [Tq, H] in the
    accumulator dtype)``. ``causal``: bottom right (``Tk >= Tq``); not causal: every query sees every key."""
    num_queries, num_heads = q.shape[:2]
    kv_heads, groups, offset = k.shape[1], q.shape[1] // k.shape[1], k.shape[0] - q.shape[0]
    full = None if causal else k.shape[0]
    acc = _accumulator_dtype(q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty(num_queries, num_heads, dtype=acc, device=q.device)
    for start in range(0, num_queries, block):
        stop = min(start + block, num_queries)
        q_block = _rows(q, start, stop, kv_heads, acc) * scale
        row_max = torch.full(q_block.shape[:2], float("-inf"), dtype=acc, device=q.device)
        row_sum = torch.zeros_like(row_max)
        numerator = torch.zeros_like(q_block)
        # A row may see no key of a block (before its window, or past its diagonal): until it sees one, its
        # maximum is -inf, and the block's scores are shifted by 0 instead (exp(-inf) = 0, never -inf - -inf).
        for key_start, key_stop, mask in _key_blocks(start, stop, offset, block, q.device, window, full):
            scores = _scores(q_block, _rows(k, key_start, key_stop, kv_heads, acc), mask, groups)
            new_max = torch.maximum(row_max, scores.amax(dim=2))
            shift = new_max.masked_fill(new_max == float("-inf"), 0.0)
            probs = scores.sub_(shift[..., None]).exp_()
            rescale = torch.exp(row_max - shift)
            row_sum = row_sum * rescale + probs.sum(dim=2)
            numerator = numerator.mul_(rescale[..., None]).baddbmm_(
                probs, _rows(v, key_start, key_stop, kv_heads, acc))
            row_max = new_max
        out[start:stop] = _unrows(numerator / row_sum[..., None], stop - start)
        lse[start:stop] = _unrows(row_max + torch.log(row_sum), stop - start)
    return out, lse


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, *, scale: float, causal: bool = True, window: int | None = None,
                       block: int = 512, grad_lse: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` from scores recomputed block by block against ``lse``, outside autograd.

    ``out`` and ``lse`` may be those of attention over *more* keys than ``k`` (this call's keys merged with
    others by their log-sum-exp): the probabilities ``exp(s - lse)`` and ``rowsum(dO * out)`` are then the merged
    attention's, and the gradients are exactly those reaching ``q`` (this part of them), ``k`` and ``v``."""
    num_queries = q.shape[0]
    kv_heads, groups, offset = k.shape[1], q.shape[1] // k.shape[1], k.shape[0] - q.shape[0]
    full = None if causal else k.shape[0]
    acc = lse.dtype
    grad_q = torch.empty_like(q)
    grad_k = torch.zeros(k.shape, dtype=acc, device=k.device)
    grad_v = torch.zeros(v.shape, dtype=acc, device=v.device)
    for start in range(0, num_queries, block):
        stop = min(start + block, num_queries)
        q_block = _rows(q, start, stop, kv_heads, acc) * scale
        grad_out_block = _rows(grad_out, start, stop, kv_heads, acc)
        # rowsum(dO * O), less d(loss)/d(lse): the log-sum-exp's own gradient enters dS as + P * dlse.
        delta = (grad_out_block * _rows(out, start, stop, kv_heads, acc)).sum(dim=2)
        if grad_lse is not None:
            delta = delta - _rows(grad_lse, start, stop, kv_heads, acc)
        row_lse = _rows(lse, start, stop, kv_heads, acc)
        grad_q_block = torch.zeros_like(q_block)
        for key_start, key_stop, mask in _key_blocks(start, stop, offset, block, q.device, window, full):
            k_block = _rows(k, key_start, key_stop, kv_heads, acc)
            v_block = _rows(v, key_start, key_stop, kv_heads, acc)
            probs = _scores(q_block, k_block, mask, groups, shift=row_lse).exp_()
            grad_v[key_start:key_stop] += (probs.transpose(1, 2) @ grad_out_block).transpose(0, 1)
            grad_scores = torch.baddbmm(delta[..., None], grad_out_block, v_block.transpose(1, 2), beta=-1).mul_(probs)
            grad_q_block.baddbmm_(grad_scores, k_block)
            grad_k[key_start:key_stop] += (grad_scores.transpose(1, 2) @ q_block).transpose(0, 1)
        grad_q[start:stop] = _unrows(grad_q_block * scale, stop - start)
    return grad_q, grad_k.to(k.dtype), grad_v.to(v.dtype)


class _LowerRightCausalAttention(torch.autograd.Function):
    """Saves ``q, k, v, out, lse``; backward recomputes the probabilities block by block."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block: int,
                window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = attention_forward(q, k, v, scale=scale, window=window, block=block)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.block, ctx.window = scale, block, window
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grads = attention_backward(grad_out, q, k, v, out, lse, scale=ctx.scale, window=ctx.window, block=ctx.block,
                                   grad_lse=grad_lse)
        return *grads, None, None, None
