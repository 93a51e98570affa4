"""Linear cross-entropy in pure torch, one chunk of tokens at a time: never more than ``[chunk_size, V]`` logits.

The forward pass keeps only the summed loss; the backward pass recomputes each chunk's logits and turns them
into the chunk's gradients, so autograd saves nothing but the inputs (``hidden``, ``weight``, ``targets``). Logits
are computed in the inputs' dtype, as ``nn.Linear`` computes them, then upcast to float32 (float64 stays float64)
for the softmax, as :func:`hybrid_pack.packed_loss` upcasts full logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.schema import IGNORE_INDEX

__all__ = ["linear_cross_entropy_sum"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[C, V]`` logits of one chunk, computed in the inputs' dtype and upcast (float32, or float64)."""
    return F.linear(hidden, weight).to(_compute_dtype(hidden.dtype))


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed loss of one chunk (its ``[C, V]`` tensors are freed on return)."""
    return F.cross_entropy(_chunk_logits(hidden, weight), targets, ignore_index=IGNORE_INDEX, reduction="sum")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_t CE(hidden[t] @ weight.T, targets[t])`` over the targets that are not ``-100``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
        total = hidden.new_zeros((), dtype=_compute_dtype(hidden.dtype))
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            total = total + _chunk_loss(hidden[start:end], weight, targets[start:end])
        ctx.save_for_backward(hidden, weight, targets)
        ctx.chunk_size = chunk_size
        return total

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden, weight, targets = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device) \
            if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            chunk, target = hidden[start:end], targets[start:end]
            # (softmax - one_hot(target)) * grad, rounded as autograd rounds cross_entropy's backward
            grad_logits = torch.log_softmax(_chunk_logits(chunk, weight), dim=-1).exp_()
            scale = ((target != IGNORE_INDEX) * grad_total).to(grad_logits.dtype).unsqueeze(1)
            grad_logits.mul_(scale).scatter_add_(1, target.clamp(min=0).unsqueeze(1), -scale)
            grad_logits = grad_logits.to(weight.dtype)  # as autograd casts the upcast logits' gradient back
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None and grad_weight.dtype == chunk.dtype:
                grad_weight.addmm_(grad_logits.T, chunk)
            elif grad_weight is not None:  # half-precision products, accumulated in float32
                grad_weight += (grad_logits.T @ chunk).to(grad_weight.dtype)
            del grad_logits  # before the next chunk's logits: one chunk's [C, V] tensors alive at a time
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             chunk_size: int) -> torch.Tensor:
    """Summed token cross-entropy of ``hidden @ weight.T`` against ``targets``, ``chunk_size`` tokens at a time.

    Args:
        hidden: ``[N, H]``, any float dtype.
        weight: ``[V, H]``, ``hidden``'s dtype.
        targets: int ``[N]``, ``-100`` ignored.
        chunk_size: tokens per chunk (the logits held at once are ``[chunk_size, V]``).

    Returns:
        A float32 scalar (float64 for float64 inputs): the sum of the targets' losses (0 with no target).
    """
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_size)
