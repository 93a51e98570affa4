"""pytest plugin: a one-line isolation test.

Enabled automatically once hybrid_pack is installed (entry point ``pytest11``)::

    def test_my_model_keeps_documents_apart(assert_isolated):
        assert_isolated(build_my_model())

Loading the plugin imports nothing beyond pytest: torch and the harness load when a test first uses the fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.fixture
def assert_isolated() -> Callable[..., Any]:
    """Run :func:`~hybrid_pack.testing.check_isolation` and fail the test with the report on a leak."""
    from hybrid_pack.testing.isolation import check_isolation

    def run(model: Any, **kwargs: Any) -> Any:
        report = check_isolation(model, **kwargs)
        if not report.ok:
            pytest.fail(str(report), pytrace=False)
        return report

    return run
