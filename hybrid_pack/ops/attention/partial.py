"""Attention of one document's queries over one part of its keys, per backend: what context-parallel attention
runs (``ops/attention/ring.py``).

A :class:`PartialAttention` takes one document's queries ``q [Tq, H, D]`` and a run of its keys and values
``k, v [Tk, Hkv, D]`` in one of two shapes:

- ``causal=True``: the queries are the last ``Tq`` of the ``Tk`` positions (``Tk >= Tq``), causal with the
  diagonal bottom right (query ``i`` sees keys ``j <= Tk - Tq + i``; with ``window``, only ``j > Tk - Tq + i -
  window`` too): flash-attn's alignment when keys outnumber queries;
- ``causal=False``: the keys all precede the queries (an earlier rank's part of the document): every query sees
  every key.

``forward`` returns ``(out [Tq, H, D] in q's dtype, lse [Tq, H])`` (``lse``: each row's log-sum-exp of its
scaled scores, float32, float64 for float64 inputs) outside autograd. ``backward(grad_out, q, k, v, out, lse)``
takes the ``out`` and ``lse`` of the *merged* attention (these keys and others, combined by log-sum-exp) and
returns this part's ``(dq, dk, dv)``: with the merged probabilities ``exp(s - lse)`` and ``rowsum(dO * out)``,
the parts' gradients sum to the merged attention's exactly.

Backends: the blockwise form (pure torch, every device and dtype: the oracle, and what the pure-torch backend
``torch`` and any backend without a partial form runs), flex attention (an offset mask, its own autograd) and
flash-attn (``_flash_attn_varlen_forward`` / ``_backward``). A kernel's partial form serves only where the
backend passed its self-check, which includes these shapes (``ops/attention/check.py``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hybrid_pack.ops.attention import blockwise

__all__ = ["PartialAttention", "partial_attention_of", "BLOCKWISE", "from_differentiable", "attend"]

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PartialAttention:
    """One backend's attention over a part of a document's keys.

    Attributes:
        backend: the attention backend's name (``"blockwise"`` for the pure-torch form).
        forward: ``(q, k, v, *, scale, causal, window) -> (out, lse)``.
        backward: ``(grad_out, q, k, v, out, lse, *, scale, causal, window) -> (dq, dk, dv)``, ``out`` and
            ``lse`` of the merged attention.

    Both return tensors of their own, aliasing no input (the ring merges into them and accumulates in them in
    place, so that it holds no second copy).
    """

    backend: str
    forward: Forward
    backward: Backward


BLOCKWISE = PartialAttention("blockwise", blockwise.attention_forward, blockwise.attention_backward)


def from_differentiable(backend: str, attend: Forward) -> PartialAttention:
    """The partial form of a backend whose ``attend(q, k, v, *, scale, causal, window) -> (out, lse)`` is
    differentiable in both outputs: the backward recomputes this part with autograd and feeds it the merged
    result's cotangents, ``w * dO`` for ``out`` and ``w * rowsum(dO * (out - O))`` for ``lse``, where
    ``w = exp(lse - LSE)`` is this part's weight in the merge (``O``, ``LSE``: the merged result)."""

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: object
                ) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return attend(q, k, v, **options)

    def backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, **options: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            part_out, part_lse = attend(*inputs, **options)
        weight = torch.exp(part_lse.to(lse.dtype) - lse)
        grad = grad_out.to(lse.dtype)
        grad_part_out = (weight[..., None] * grad).to(part_out.dtype)
        grad_part_lse = (weight * (grad * (part_out.to(lse.dtype) - out.to(lse.dtype))).sum(-1)).to(part_lse.dtype)
        dq, dk, dv = torch.autograd.grad((part_out, part_lse), inputs, (grad_part_out, grad_part_lse),
                                         allow_unused=True)
        return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(inputs, (dq, dk, dv)))  # type: ignore

    return PartialAttention(backend, forward, backward)


_KERNELS = {
    "flash_attn": "hybrid_pack.ops.attention.kernel_flash_attn:PARTIAL",
    "flex": "hybrid_pack.ops.attention.kernel_flex:PARTIAL",
}
"""Backends with a partial form of their own (imported on first use); every other one runs :data:`BLOCKWISE`."""


@functools.cache
def partial_attention_of(backend: str) -> PartialAttention:
    """The partial form of attention backend ``backend``: its kernel's where it has one, else :data:`BLOCKWISE`."""
    target = _KERNELS.get(backend)
    if target is None:
        return BLOCKWISE
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


class _Attend(torch.autograd.Function):
    """One partial attention as a differentiable op (its own output and log-sum-exp are the merged ones)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, partial: PartialAttention,
                options: dict[str, Any]) -> torch.Tensor:
        out, lse = partial.forward(q, k, v, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.partial, ctx.options = partial, options
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        return (*ctx.partial.backward(grad_out, q, k, v, out, lse, **ctx.options), None, None)


def attend(partial: PartialAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
           causal: bool, window: int | None = None) -> torch.Tensor:
    """``partial``'s attention of ``q [Tq, H, D]`` over all of ``k, v [Tk, Hkv, D]``, differentiable:
    ``[Tq, H, D]`` in q's dtype."""
    return _Attend.apply(q, k, v, partial, {"scale": float(scale), "causal": causal, "window": window})
