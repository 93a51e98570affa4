"""The cross-contamination harness (docs/api.md §7) and the runtime guard (§7a): prove a packed model never
mixes documents, before training and while it trains. Every name loads on first use."""

from __future__ import annotations

from hybrid_pack.lazy import lazy_attributes

_LAZY = {
    "IsolationError": "hybrid_pack.errors",
    "TOLERANCE": "hybrid_pack.isolation",
    "Layout": "hybrid_pack.isolation",
    "adversarial_layouts": "hybrid_pack.isolation",
    "model_geometry": "hybrid_pack.isolation",
    "GuardRecord": "hybrid_pack.testing.guard",
    "IsolationWarning": "hybrid_pack.testing.guard",
    "PackingGuard": "hybrid_pack.testing.guard",
    "InvarianceReport": "hybrid_pack.testing.invariance",
    "check_invariance": "hybrid_pack.testing.invariance",
    "assert_isolated": "hybrid_pack.testing.isolation",
    "check_isolation": "hybrid_pack.testing.isolation",
    "DocumentResult": "hybrid_pack.testing.report",
    "IsolationReport": "hybrid_pack.testing.report",
    "LayoutResult": "hybrid_pack.testing.report",
    "check_training_step": "hybrid_pack.testing.training_step",
}

__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
