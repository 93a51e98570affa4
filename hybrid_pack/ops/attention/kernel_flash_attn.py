"""flash-attn adapter: ``flash_attn_varlen_func`` with ``cu_seqlens``.

The packed row ``[1, T, H, D]`` becomes flash-attn's ``[T, H, D]`` with int32 ``cu_seqlens`` for
queries and keys and the Python-int ``max_seqlen`` (a tensor would sync the host). Grouped-query
attention is native: k/v keep their ``Hkv`` heads. The padding segment is its own sequence.
flash-attn takes float16 / bfloat16 only and head dims up to 256. A sliding window of ``window`` keys is
``window_size=(window - 1, 0)``: flash's left reach is inclusive of the ``window - 1`` keys before the token.

:data:`PARTIAL` is its form for context-parallel attention (:mod:`hybrid_pack.ops.attention.partial`): one
document's queries over more keys through ``_flash_attn_varlen_forward`` / ``_backward`` (``cu_seqlens_q =
[0, Tq]``, ``cu_seqlens_k = [0, Tk]``): ``causal=True`` aligns the diagonal bottom right when keys outnumber
queries (flash-attn >= 2.1), ``causal=False`` sees every earlier key; the backward takes the merged output and
log-sum-exp, so each part's gradients are exact without differentiating the log-sum-exp.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.attention.kernel_torch_varlen import window_size
from hybrid_pack.ops.attention.partial import PartialAttention

__all__ = ["varlen_attention", "flash_attn_accepts", "MAX_HEAD_DIM", "PARTIAL"]

MAX_HEAD_DIM = 256


def flash_attn_accepts(inputs: Mapping[str, Any]) -> str:
    """"" if ``flash_attn_varlen_func`` takes these attention inputs, else why not."""
    head_dim = inputs["q"].shape[-1]
    if head_dim > MAX_HEAD_DIM:
        return f"flash_attn_varlen_func takes head dims up to {MAX_HEAD_DIM}; got {head_dim}"
    return ""


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, boundaries: PackedBoundaries, *,
                     causal: bool, softmax_scale: float, window: int | None = None) -> torch.Tensor:
    """:func:`hybrid_pack.ops.varlen_attention` through ``flash_attn_varlen_func(cu_seqlens_q=cu_seqlens_k=...)``."""
    from flash_attn import flash_attn_varlen_func

    cu_seqlens, max_seqlen = boundaries.cu_seqlens, boundaries.max_seqlen
    out = flash_attn_varlen_func(q[0], k[0], v[0], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                 softmax_scale=softmax_scale, causal=causal, window_size=window_size(causal, window))
    return out.unsqueeze(0)


@functools.cache
def _varlen_pair() -> tuple[Any, Any, bool]:
    """flash-attn's ``(_flash_attn_varlen_forward, _flash_attn_varlen_backward, split)``: ``split`` when they take
    ``window_size_left`` / ``_right`` (2.7) instead of one ``window_size`` pair (2.6)."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward

    return (_flash_attn_varlen_forward, _flash_attn_varlen_backward,
            "window_size_left" in inspect.signature(_flash_attn_varlen_forward).parameters)


def _part_options(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, window: int | None, split: bool
                  ) -> dict[str, Any]:
    """The keywords both private functions share for one document of ``Tq`` queries over ``Tk`` keys."""
    left, right = window_size(causal, window)
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
    windows = {"window_size_left": left, "window_size_right": right} if split else {"window_size": (left, right)}
    return {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k, "max_seqlen_q": q.shape[0], "max_seqlen_k": k.shape[0],
            "dropout_p": 0.0, "softmax_scale": scale, "causal": causal, "softcap": 0.0, "alibi_slopes": None,
            **windows}


def _part_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                  window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [Tq, H, D], lse [Tq, H] float32)`` of one document's queries over ``k, v [Tk, Hkv, D]``."""
    forward, _, split = _varlen_pair()
    options = _part_options(q, k, scale, causal, window, split)
    result = forward(q, k, v, return_softmax=False, block_table=None, **options)
    out, lse = result[0], result[-3]  # (out, lse, S, rng) in 2.7; (out, q, k, v, out_padded, lse, S, rng) in 2.6
    return out, lse.transpose(0, 1)


def _part_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, scale: float, causal: bool, window: int | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This part's ``(dq, dk, dv)`` against the merged ``out [Tq, H, D]`` and ``lse [Tq, H]``."""
    _, backward, split = _varlen_pair()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    backward(grad_out.to(q.dtype).contiguous(), q, k, v, out.to(q.dtype).contiguous(),
             lse.float().transpose(0, 1).contiguous(), dq, dk, dv, deterministic=False,
             **_part_options(q, k, scale, causal, window, split))
    return dq, dk, dv


PARTIAL = PartialAttention("flash_attn", _part_forward, _part_backward)
