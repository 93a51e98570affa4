"""torch adapter: ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.11, CUDA flash kernel) with ``cu_seqlens``.

Same argument forms as flash-attn: ``[T, H, D]`` rows, int32 ``cu_seq_q = cu_seq_k`` and Python-int
maximum lengths. Causal masking is ``window_size=(-1, 0)``; a sliding window of ``window`` keys is
``window_size=(window - 1, 0)`` (flash's inclusive left reach: the token and ``window - 1`` before it; torch
runs it on its flash kernel, never cuDNN, which refuses windows). Grouped-query attention is
``enable_gqa=True`` where this torch has the argument (2.13 does); torch 2.11-2.12's ``varlen_attn``
has none and documents equal head counts, so there the key/value heads are repeated up to the query
heads first. On CPU the op has no kernel (``aten::_flash_attention_forward`` is CUDA only).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["varlen_attention", "varlen_attn_probe", "takes_enable_gqa", "window_size"]

CAUSAL_WINDOW = (-1, 0)
FULL_WINDOW = (-1, -1)


def varlen_attn_probe() -> str:
    """"" if this torch's ``torch.nn.attention.varlen.varlen_attn`` takes ``scale`` and ``window_size``, else why."""
    try:
        found = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    except ImportError:
        found = False
    if not found:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (needs torch >= 2.11)"
    missing = {"scale", "window_size"} - set(inspect.signature(_varlen_attn()).parameters)
    if missing:
        return f"torch {torch.__version__}'s varlen_attn takes no {', '.join(sorted(missing))} (needs torch >= 2.11)"
    return ""


@functools.cache
def _varlen_attn() -> Callable[..., Any]:
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


@functools.cache
def takes_enable_gqa(fn: Callable[..., Any] | None = None) -> bool:
    """Whether ``varlen_attn`` (or ``fn``) takes ``enable_gqa`` (read from its signature, once)."""
    return "enable_gqa" in inspect.signature(fn or _varlen_attn()).parameters


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                     causal: bool, softmax_scale: float, window: int | None = None) -> torch.Tensor:
    """:func:`hybrid_pack.ops.varlen_attention` through ``varlen_attn(cu_seq_q=cu_seq_k=cu_seqlens)``."""
    varlen_attn = _varlen_attn()
    grouped = q.shape[2] != k.shape[2]
    options: dict[str, Any] = {}
    if grouped and takes_enable_gqa(varlen_attn):
        options["enable_gqa"] = True
    elif grouped:
        k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    cu_seqlens, max_seqlen = boundaries.cu_seqlens, boundaries.max_seqlen
    out = varlen_attn(q[0], k[0], v[0], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=softmax_scale,
                      window_size=window_size(causal, window), **options)
    return out.unsqueeze(0)


def window_size(causal: bool, window: int | None) -> tuple[int, int]:
    """flash's ``(left, right)`` reach (inclusive, -1 unbounded) for causal attention, optionally over ``window``
    keys (the token itself and ``window - 1`` before it), or full attention."""
    if window is not None:
        return (window - 1, 0)
    return CAUSAL_WINDOW if causal else FULL_WINDOW
