"""flash-linear-attention's own context parallelism for the causal conv (``fla.modules.causal_conv1d.cp``).

``causal_conv1d_cp(x, weight, bias, activation, cp_context=build_cp_context(row cu_seqlens, group,
conv1d_kernel_size=W))`` receives the previous rank's last ``W - 1`` tokens where the document continues
(none where a document starts on the rank edge) and sends their gradient back in the backward. Its
limits, each refused with the reason by :func:`fla_cp_refusal`: CUDA over NCCL only
(:mod:`hybrid_pack.ops.fla_cp`), the contiguous layout, float16, bfloat16 or float32, activation None or
"silu", batch 1 and a row length divisible by the group's size (every :class:`ShardedBoundaries` is).

It serves a call only after the collective self-check (:mod:`hybrid_pack.ops.dispatch.cp_check`) passed
for the call's key on the whole group. Hooked into the pure-torch context-parallel conv (``.cp``) as its
first choice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybrid_pack.ops.conv.check import OP, signature_of
from hybrid_pack.ops.dispatch.cp_check import cp_backend_serves, register_cp_backend
from hybrid_pack.ops.fla_cp import FLA_CP, fla_cp_context, fla_cp_device_reason, fla_cp_reason
from hybrid_pack.parallel.boundaries import ShardedBoundaries

__all__ = ["fla_cp_refusal", "causal_conv1d_fla_cp", "fla_cp_serves"]

register_cp_backend(OP, FLA_CP, fla_cp_device_reason)


def fla_cp_refusal(x: torch.Tensor, boundaries: ShardedBoundaries) -> str:
    """Why fla's context-parallel conv cannot take this call ("" when it can, pending the self-check)."""
    return fla_cp_reason(fla_cp_device_reason(x.device), boundaries, x.dtype)


def causal_conv1d_fla_cp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         boundaries: ShardedBoundaries, *, activation: str | None) -> torch.Tensor:
    """This rank's part of :func:`hybrid_pack.ops.causal_conv1d` through fla's ``causal_conv1d_cp``."""
    from fla.modules.causal_conv1d.cp import causal_conv1d_cp

    context = fla_cp_context(boundaries, x.device, conv_width=weight.shape[1])
    return causal_conv1d_cp(x, weight, bias, activation=activation, cp_context=context, backend="triton")


def fla_cp_serves(backend: str | None, reference: Callable[..., Any], x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, boundaries: ShardedBoundaries, *, activation: str | None) -> bool:
    """Whether fla's context-parallel conv serves this call (see :func:`cp_backend_serves`); ``reference`` is
    the pure-torch context-parallel op the collective self-check compares it with."""
    return cp_backend_serves(OP, FLA_CP, backend, lambda: fla_cp_refusal(x, boundaries), causal_conv1d_fla_cp,
                             reference, lambda: signature_of(x, weight, bias, activation), boundaries, x.device,
                             any(t is not None and t.requires_grad for t in (x, weight, bias)))
