"""flash-linear-attention's own context parallelism for the causal conv (``fla.modules.causal_conv1d.cp``).

``causal_conv1d_cp(x, weight, bias, activation, cp_context=build_cp_context(row cu_seqlens, group,
conv1d_kernel_size=W))`` receives the previous rank's last ``W - 1`` tokens where the document continues
(none where a document starts on the rank edge) and sends their gradient back in the backward. Its
limits, each refused with the reason by :func:`device_probe` and :func:`fla_cp_accepts`: CUDA over NCCL only
(:mod:`hybrid_pack.ops.fla_cp`), the contiguous layout, float16, bfloat16 or float32, activation None or
"silu", batch 1 and a row length divisible by the group's size (every :class:`ShardedBoundaries` is).

Registered as the op's sharded backend ``fla_cp``: it serves a call only with the group's settled verdict of
its collective self-check (:mod:`hybrid_pack.ops.selfcheck.sharded_row`, run by ``hybrid_pack.backends.verify()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.ops.fla_cp import fla_cp_context, fla_cp_device_reason, fla_cp_reason

__all__ = ["device_probe", "fla_cp_accepts", "causal_conv1d_fla_cp"]


def device_probe(device: torch.device, dtype: torch.dtype) -> str:
    """Why fla's context-parallel conv cannot run on ``device`` here ("" when it may)."""
    return fla_cp_device_reason(device)


def fla_cp_accepts(inputs: Mapping[str, Any]) -> str:
    """Why fla's context-parallel conv cannot take this call ("" when it can, pending its collective self-check)."""
    return fla_cp_reason("", inputs["boundaries"], inputs["x"].dtype)


def causal_conv1d_fla_cp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         boundaries: ShardedBoundaries, *, activation: str | None) -> torch.Tensor:
    """This rank's part of :func:`hybrid_pack.ops.causal_conv1d` through fla's ``causal_conv1d_cp``."""
    from fla.modules.causal_conv1d.cp import causal_conv1d_cp

    context = fla_cp_context(boundaries, x.device, conv_width=weight.shape[1])
    return causal_conv1d_cp(x, weight, bias, activation=activation, cp_context=context, backend="triton")
