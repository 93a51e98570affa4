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

It serves a call only after the collective self-check (:mod:`hybrid_pack.ops.dispatch.cp_check`) passed
for the call's key on the whole group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybrid_pack.errors import InputError
from hybrid_pack.ops.dispatch.cp_check import cp_backend_serves, register_cp_backend
from hybrid_pack.ops.fla_cp import FLA_CP, fla_cp_context, fla_cp_device_reason, fla_cp_reason
from hybrid_pack.ops.gated_delta import fla_hopper
from hybrid_pack.ops.gated_delta.check import OP, signature_of
from hybrid_pack.ops.gated_delta.kernel_fla import MAX_HEAD_DIM
from hybrid_pack.parallel.boundaries import ShardedBoundaries

__all__ = ["device_reason", "fla_cp_refusal", "gated_delta_rule_fla_cp", "fla_cp_serves"]


def device_reason(device: torch.device) -> str:
    """Why fla's context-parallel gated delta rule cannot run on ``device`` here ("" when it may)."""
    reason = fla_cp_device_reason(device)
    if not reason and torch.cuda.get_device_capability(device)[0] < 8:
        reason = "fla's gated delta rule context parallelism needs compute capability >= 8.0 (TF32x3 affine chain)"
    return reason


register_cp_backend(OP, FLA_CP, device_reason)


def fla_cp_refusal(q: torch.Tensor, boundaries: ShardedBoundaries, *, initial_state: torch.Tensor | None,
                   output_final_state: bool) -> str:
    """Why fla's context parallelism cannot take this call ("" when it can, pending the self-check)."""
    reason = fla_cp_reason(device_reason(q.device), boundaries, q.dtype)
    if reason:
        return reason
    if initial_state is not None or output_final_state:
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


def fla_cp_serves(backend: str | None, reference: Callable[..., Any], q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, boundaries: ShardedBoundaries, *,
                  initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm: bool) -> bool:
    """Whether fla's context parallelism serves this call (see :func:`cp_backend_serves`); ``reference`` is
    the pure-torch context-parallel op the collective self-check compares it with."""
    return cp_backend_serves(
        OP, FLA_CP, backend,
        lambda: fla_cp_refusal(q, boundaries, initial_state=initial_state, output_final_state=output_final_state),
        gated_delta_rule_fla_cp, reference,
        lambda: signature_of(q, k, v, g, beta, initial_state=None, output_final_state=False,
                             use_qk_l2norm=use_qk_l2norm),
        boundaries, q.device, any(t.requires_grad for t in (q, k, v, g, beta)))
