"""The conformance tier's expected failures turn red when they fail otherwise: ``expecting_failure`` on a
``unittest`` class under pytest, as the tier uses it. A listed failure with its type and message is an xfail; one
with another exception type, another message (a new failure behind the same assertion type, as a patched-only
failure would be), or none at all (strict) fails, and so does the same test with the marks off (the table's run).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conformance.known_both_modes import KNOWN, LISTED_OTHERWISE

pytestmark = pytest.mark.conformance

ROOT = Path(__file__).resolve().parents[2]

CASES = '''
import unittest

from tests.conformance.known_both_modes import Expected, expecting_failure

EXPECTED = Expected(AssertionError, r"^1 != 3$", "one attention map of three layers")


class Cases:
    def test_as_listed(self):
        self.assertEqual(1, 3)

    def test_other_message(self):
        self.assertEqual(2, 3)

    def test_other_type(self):
        raise ValueError("1 != 3")

    def test_passes(self):
        pass

    def test_skips(self):
        self.skipTest("no accelerator")

    def test_subtest_as_listed(self):
        with self.subTest("first"):
            self.assertEqual(1, 3)


for mark in (True, False):
    cls = type(f"TestMarked{mark}", (Cases, unittest.TestCase), {})
    for name in [attr for attr in dir(cls) if attr.startswith("test_")]:
        setattr(cls, name, expecting_failure(getattr(Cases, name), "family", EXPECTED, mark=mark))
    globals()[cls.__name__] = cls
'''


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], str]:
    """``{(class, test): outcome}`` of :data:`CASES` run by pytest: ``TestMarkedTrue`` as the tier runs, with the
    marks; ``TestMarkedFalse`` as ``scripts/conformance_table.py`` runs, without."""
    tmp_path = tmp_path_factory.mktemp("expected_failures")
    test_file, junit = tmp_path / "test_cases.py", tmp_path / "cases.xml"
    test_file.write_text(CASES)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    f"--rootdir={tmp_path}", str(test_file), f"--junitxml={junit}"],
                   cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, check=False)
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                is_xfail = tag == "skipped" and "xfail" in (element.get("type") or "")
                outcome = {"failure": "failed", "error": "failed"}.get(tag, "xfailed" if is_xfail else "skipped")
                if tag == "failure" and LISTED_OTHERWISE in (element.get("message") or ""):
                    outcome = "failed otherwise"
                break
        results[(case.get("classname").rsplit(".", 1)[-1], case.get("name"))] = outcome
    return results


def _of(outcomes: dict[tuple[str, str], str], cls: str) -> dict[str, str]:
    return {test: outcome for (owner, test), outcome in outcomes.items() if owner == cls}


def test_listed_failures_fail_the_tier_when_they_fail_otherwise(outcomes: dict[tuple[str, str], str]) -> None:
    assert _of(outcomes, "TestMarkedTrue") == {
        "test_as_listed": "xfailed", "test_subtest_as_listed": "xfailed",
        "test_other_message": "failed otherwise", "test_other_type": "failed otherwise",
        "test_passes": "failed",  # strict: XPASS(strict)
        "test_skips": "skipped",
    }


def test_unmarked_run_keeps_the_check(outcomes: dict[tuple[str, str], str]) -> None:
    assert _of(outcomes, "TestMarkedFalse") == {
        "test_as_listed": "failed", "test_subtest_as_listed": "failed",
        "test_other_message": "failed otherwise", "test_other_type": "failed otherwise",
        "test_passes": "passed", "test_skips": "skipped",
    }


def test_every_listed_entry_is_well_formed() -> None:
    for test, families in KNOWN.items():
        for family, expected in families.items():
            assert isinstance(expected.raises, type) and issubclass(expected.raises, Exception), (test, family)
            assert expected.reason, (test, family)
            re.compile(expected.match)
