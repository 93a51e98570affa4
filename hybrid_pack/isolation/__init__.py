"""What every "packed equals alone" check shares: one error measure and comparison, one tolerance table,
one module of adversarial layouts.

The backends' self-check (``ops/selfcheck/whole_row.py``), the context-parallel collective check
(``ops/selfcheck/sharded_row.py``), the harness (``testing/isolation.py``), the training-step check
(``testing/training_step.py``) and the runtime guard (``testing/guard.py``) are built on it. It sits just
above the boundaries in the data flow (docs/architecture.md): it imports ``hybrid_pack.boundaries``,
``hybrid_pack.errors``, the key names of ``hybrid_pack.schema`` and torch only.
"""

from hybrid_pack.isolation.compare import Mismatch, assert_gradient_inside, compare, leaked_gradient, relative_error
from hybrid_pack.isolation.layouts import (
    REAL_TOKENS,
    Layout,
    adversarial_cp_row,
    adversarial_layouts,
    model_geometry,
    one_document_layout,
    real_size_layout,
    selfcheck_layout,
    short_document_layout,
)
from hybrid_pack.isolation.tolerance import (
    GRADIENT_FACTOR,
    SELF_CHECK_TOLERANCE,
    TOLERANCE,
    least_precise,
    self_check_tolerance,
    tolerance_for,
)
from hybrid_pack.isolation.vision import VISION_INPUT_KEYS, document_vision_inputs

__all__ = ["TOLERANCE", "SELF_CHECK_TOLERANCE", "GRADIENT_FACTOR", "least_precise", "tolerance_for",
           "self_check_tolerance",
           "Mismatch", "relative_error", "compare", "leaked_gradient", "assert_gradient_inside",
           "Layout", "adversarial_layouts", "model_geometry", "selfcheck_layout", "adversarial_cp_row",
           "REAL_TOKENS", "real_size_layout", "short_document_layout", "one_document_layout",
           "VISION_INPUT_KEYS", "document_vision_inputs"]
