"""MoE experts in batch-invariant mode (docs/rl.md): transformers' ``batched_mm``, or a refusal."""

from __future__ import annotations

from typing import Any

import torch

from hybrid_pack.errors import UnsupportedModelError
from hybrid_pack.ops.invariant import is_batch_invariant

__all__ = ["BATCH_INVARIANT_EXPERTS", "experts_modules", "refuse_varying_experts"]

BATCH_INVARIANT_EXPERTS = "batched_mm"
"""transformers' experts implementation that computes each token's expert GEMMs on its own rows: its ``grouped_mm``
and eager paths round with the number of tokens an expert receives, which the packing changes (measured: 1-4 ULP
on tiny MoE families)."""


def experts_modules(modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The MoE experts modules among ``modules``: those transformers' ``use_experts_implementation`` dispatches by
    ``config._experts_implementation``."""
    return [m for m in modules if hasattr(m, "_is_expert_parallel")
            and hasattr(getattr(m, "config", None), "_experts_implementation")]


def refuse_varying_experts(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook of an experts module: inside :func:`hybrid_pack.batch_invariant`, experts that do not run
    :data:`BATCH_INVARIANT_EXPERTS` raise :class:`UnsupportedModelError` (their rounding follows the packing)."""
    implementation = module.config._experts_implementation
    if implementation != BATCH_INVARIANT_EXPERTS and is_batch_invariant():
        raise UnsupportedModelError(
            f"{type(module).__name__}: experts_implementation={implementation!r} rounds with how many tokens each "
            f"expert receives, which the packing changes; inside batch_invariant() call "
            f"model.set_experts_implementation({BATCH_INVARIANT_EXPERTS!r}) first (the trainers' "
            "batch_invariant=True does it for the policy and the reference model)")
