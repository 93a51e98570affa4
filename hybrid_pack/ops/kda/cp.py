"""Kimi Delta Attention on one rank's slice of a row split across a context-parallel group (docs/api.md §10).

The gated delta rule's state passing (:mod:`hybrid_pack.ops.gated_delta.cp`) carries over unchanged: over one
segment the state still goes through an affine map ``S_out = M S_in + S0``, now with
``M = prod_t (I - beta_t k_t k_t^T) diag(exp(g_t))`` (``[HV, K, K]``), and value columns are still independent,
so widening the values by ``K`` zero columns whose state starts as the identity yields ``M`` and the per-token
corrections from the local op itself. The per-channel decay ``g [1, T, HV, K]`` goes to the local op as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.ops.gated_delta.cp import gated_delta_rule_cp

__all__ = ["kda_cp"]


def kda_cp(op: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], q: torch.Tensor, k: torch.Tensor,
           v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, boundaries: ShardedBoundaries, *, scale: float,
           initial_state: torch.Tensor | None, output_final_state: bool, use_qk_l2norm: bool, backend: str | None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's part of :func:`hybrid_pack.ops.kda.kda` on the whole row.

    Args and returns as :func:`~hybrid_pack.ops.gated_delta.cp.gated_delta_rule_cp`, with ``g [1, T_local, HV, K]``:
    ``initial_state [N_local, HV, K, V]`` belongs to the rank where its document starts; the final states are each
    local document's state after its last token on this rank.
    """
    return gated_delta_rule_cp(op, q, k, v, g, beta, boundaries, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm, backend=backend)
