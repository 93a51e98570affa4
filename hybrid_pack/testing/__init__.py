"""The cross-contamination harness (docs/api.md §7) and the runtime guard (§7a): prove a packed model never
mixes documents, before training and while it trains."""

from hybrid_pack.errors import IsolationError
from hybrid_pack.isolation import TOLERANCE, Layout, adversarial_layouts, model_geometry
from hybrid_pack.testing.guard import GuardRecord, IsolationWarning, PackingGuard
from hybrid_pack.testing.invariance import InvarianceReport, check_invariance
from hybrid_pack.testing.isolation import assert_isolated, check_isolation
from hybrid_pack.testing.report import DocumentResult, IsolationReport, LayoutResult
from hybrid_pack.testing.training_step import check_training_step

__all__ = ["check_isolation", "check_training_step", "assert_isolated", "IsolationError", "IsolationReport",
           "LayoutResult", "DocumentResult", "Layout", "adversarial_layouts", "model_geometry", "TOLERANCE",
           "PackingGuard", "GuardRecord", "IsolationWarning", "check_invariance", "InvarianceReport"]
