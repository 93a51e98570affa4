"""pytest plugin: a one-line isolation test.

Enabled automatically once hybrid_pack is installed (entry point ``pytest11``)::

    def test_my_model_keeps_documents_apart(assert_isolated):
        assert_isolated(build_my_model())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hybrid_pack.testing.isolation import check_isolation
from hybrid_pack.testing.report import IsolationReport


@pytest.fixture
def assert_isolated() -> Callable[..., IsolationReport]:
    """Run :func:`~hybrid_pack.testing.check_isolation` and fail the test with the report on a leak."""

    def run(model: torch.nn.Module, **kwargs: Any) -> IsolationReport:
        report = check_isolation(model, **kwargs)
        if not report.ok:
            pytest.fail(str(report), pytrace=False)
        return report

    return run
