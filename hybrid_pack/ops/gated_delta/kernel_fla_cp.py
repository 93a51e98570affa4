"""flash-linear-attention's own context parallelism for the gated delta rule (``fla.ops.cp``).

``chunk_gated_delta_rule(..., cp_context=build_cp_context(row cu_seqlens, group))`` summarises each rank's
last sequence as an affine map of its incoming state, all-gathers the maps and folds them in its
kernels, forward and backward: the scheme of the pure-torch path (:mod:`.cp`), fused. Its limits,
each refused with the reason by :func:`fla_cp_refusal`:

* CUDA over NCCL only (:mod:`hybrid_pack.ops.fla_cp`), compute capability 8.0 or newer (its affine
  chain runs in TF32x3);
* no initial states and no final states;
* the contiguous layout; key head dims up to 256; float16, bfloat16 or float32;
* batch 1 and a row length divisible by the group's size (every :class:`ShardedBoundaries` is).

Registered as the op's sharded backend ``fla_cp``: it serves a call only with the group's settled verdict of
its collective self-check (:mod:`hybrid_pack.ops.selfcheck.sharded_row`, run by ``hybrid_pack.backends.verify()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.ops.fla_cp import fla_cp_context, fla_cp_device_reason, fla_cp_reason
from hybrid_pack.ops.gated_delta import fla_hopper
from hybrid_pack.ops.gated_delta.kernel_fla import MAX_HEAD_DIM

__all__ = ["device_reason", "device_probe", "fla_cp_accepts", "gated_delta_rule_fla_cp"]


def device_reason(device: torch.device) -> str:
    """Why fla's context-parallel gated delta rule cannot run on ``device`` here ("" when it may)."""
    reason = fla_cp_device_reason(device)
    if not reason and torch.cuda.get_device_capability(device)[0] < 8:
        reason = "fla's gated delta rule context parallelism needs compute capability >= 8.0 (TF32x3 affine chain)"
    return reason


def device_probe(device: torch.device, dtype: torch.dtype) -> str:
    """:func:`device_reason`, as the registry asks it (the dtype is checked by ``accepts``)."""
    return device_reason(device)


def fla_cp_accepts(inputs: Mapping[str, Any]) -> str:
    """Why fla's context parallelism cannot take this call ("" when it can, pending its collective self-check)."""
    q = inputs["q"]
    reason = fla_cp_reason("", inputs["boundaries"], q.dtype)
    if reason:
        return reason
    if inputs["initial_state"] is not None or inputs["output_final_state"]:
        return "fla's context parallelism takes no initial states and returns no final states"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"fla's chunk_gated_delta_rule takes key head dims up to {MAX_HEAD_DIM}; got {q.shape[-1]}"
    return ""


def gated_delta_rule_fla_cp(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            boundaries: ShardedBoundaries, *, scale: float | None = None,
                            initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                            use_qk_l2norm: bool = False) -> tuple[torch.Tensor, None]:
    """This rank's part of :func:`hybrid_pack.ops.gated_delta_rule` through fla's
    ``chunk_gated_delta_rule(cp_context=...)``; called as the op (states must be unset)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    if initial_state is not None or output_final_state:
        raise InputError("initial_state: fla's context parallelism takes no initial states and returns no final "
                         "states; use the pure-torch path (backend='torch')")
    fla_hopper.install()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm,
                                  cp_context=fla_cp_context(boundaries, q.device))
    return o, None
