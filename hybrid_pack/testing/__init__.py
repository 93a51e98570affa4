"""The cross-contamination harness (SPEC §7): prove a packed model never mixes documents."""

from hybrid_pack.testing.isolation import DEFAULT_ATOL, IsolationError, assert_isolated, check_isolation
from hybrid_pack.testing.layouts import Layout, adversarial_layouts, model_geometry
from hybrid_pack.testing.report import DocumentResult, IsolationReport, LayoutResult
from hybrid_pack.testing.training_step import check_training_step

__all__ = ["check_isolation", "check_training_step", "assert_isolated", "IsolationError", "IsolationReport",
           "LayoutResult", "DocumentResult", "Layout", "adversarial_layouts", "model_geometry", "DEFAULT_ATOL"]
