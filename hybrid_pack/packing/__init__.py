"""Grouping documents into packed rows: offline plans, a distributed batch sampler, streaming
packing and RL rollout packing."""

from __future__ import annotations

from hybrid_pack.lazy import lazy_attributes

_LAZY = {
    "PackPlan": "hybrid_pack.packing.plan",
    "plan_packs": "hybrid_pack.packing.plan",
    "PackedBatchSampler": "hybrid_pack.packing.sampler",
    "pack_stream": "hybrid_pack.packing.streaming",
    "pack_rollouts": "hybrid_pack.packing.rollouts",
    "unpack_rollouts": "hybrid_pack.packing.rollouts",
    "tool_masks_from_trl": "hybrid_pack.packing.rollouts",
    "PackStream": "hybrid_pack.packing.streaming",
    "SlicedDataset": "hybrid_pack.packing.slicing",
    "TokenSlice": "hybrid_pack.packing.slicing",
    "TokenCost": "hybrid_pack.packing.balance",
    "tokenize_and_plan": "hybrid_pack.packing.hf_datasets",
    "packing_report": "hybrid_pack.packing.report",
}

__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
