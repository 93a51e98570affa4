"""The conformance tier's table (docs/api.md §6a): transformers' common model tests per family, unpatched and patched.

Runs ``tests/conformance/test_hf_model_tester.py`` and ``tests/conformance/test_packed_rows.py`` once with
``HYBRID_PACK_CONFORMANCE_RAW=1`` (no expected-failure marks: every test's real outcome, both modes in the same
run), then prints per family the tests collected / passed / failed / skipped in each mode and the outcome of its
packed-row check, then: the families whose test classes could not be built, every test that passes unpatched but
not patched (the contract: none) with the first line of its patched error, every test failing in both modes with
its first error line and its reason from ``tests/conformance/known_both_modes.py`` (or ``NOT LISTED``), the listed
tests that failed with another exception type or message than listed, the entries of that list that no longer
fail in both modes, the packed-row failures, the families of ``FAMILIES`` without a tiny config, and the tests
skipped in both modes grouped by skip reason.

Usage (from the repository root)::

    .venv/bin/python scripts/conformance_table.py                 # the whole tier, pytest -n 2
    .venv/bin/python scripts/conformance_table.py -k Bamba -n 0   # one family (class token or family key)
    .venv/bin/python scripts/conformance_table.py --junit R.xml   # an earlier run's JUnit XML (no run)

Exit status: 0 when the contract holds, the list of both-mode failures is exact (types and messages included), every
family builds, has a tiny config and passes its packed-row check; 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conformance.family_tester import CONFORMANCE_FAMILIES  # noqa: E402
from tests.conformance.known_both_modes import LISTED_OTHERWISE, reason_for  # noqa: E402

TIER = ("tests/conformance/test_hf_model_tester.py", "tests/conformance/test_packed_rows.py")
MODES = ("Unpatched", "Patched")
PACKED = "Packed"          # the mode of test_packed_rows.py's test_packed_row_matches_batch_rows[<family>]
COVERAGE = "Coverage"      # test_packed_rows.py's test_family_has_a_tiny_config[<FAMILIES name>]
CLASS = re.compile(r"\.TestHF(?P<family>\w+?)(?P<mode>Unpatched|Patched)$")
PARAMETRIZED = re.compile(r"^(?P<test>test_packed_row_matches_batch_rows|test_family_has_a_tiny_config)"
                          r"\[(?P<key>.+)\]$")
UNBUILDABLE = "test_family_builds"
FAMILIES = {"".join(part.title() for part in family.split("_")): family for family in CONFORMANCE_FAMILIES}
RANK = {"failed": 3, "passed": 2, "xfailed": 1, "skipped": 0}


def first_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0][:200] if lines else ""


def outcomes(junit: Path) -> dict[tuple[str, str], dict[str, tuple[str, str]]]:
    """``{(family, mode): {test: (outcome, first line of its error or skip reason)}}``; a test reported more
    than once (subtests) takes its worst outcome."""
    results: dict[tuple[str, str], dict[str, tuple[str, str]]] = defaultdict(dict)
    for case in ET.parse(junit).getroot().iter("testcase"):
        match, name = CLASS.search(case.get("classname", "")), case.get("name", "")
        parametrized = PARAMETRIZED.match(name)
        if match is not None and match["family"] in FAMILIES:
            family, mode = FAMILIES[match["family"]], match["mode"]
        elif parametrized is not None:
            packed = parametrized["test"] == "test_packed_row_matches_batch_rows"
            family, mode, name = parametrized["key"], PACKED if packed else COVERAGE, parametrized["test"]
        else:
            continue
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                detail = first_line(element.get("message") or element.text)
                if tag != "skipped":
                    outcome = "failed"
                elif "xfail" in (element.get("type") or ""):
                    outcome = "xfailed"
                else:
                    outcome = "skipped"
                break
        bucket = results[(family, mode)]
        if name not in bucket or RANK[outcome] > RANK[bucket[name][0]]:
            bucket[name] = (outcome, detail)
    return results


def run(args: argparse.Namespace, junit: Path) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings", *args.path,
               f"--junitxml={junit}"]
    if args.n:
        command += ["-n", str(args.n)]
    if args.k:
        command += ["-k", args.k]
    env = dict(os.environ, HYBRID_PACK_CONFORMANCE_RAW="1")
    print("$", " ".join(command), file=sys.stderr)
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def report(results: dict[tuple[str, str], dict[str, tuple[str, str]]]) -> bool:
    """Print the table and the lists; whether the contract holds and the known list is exact."""
    ok = True
    families = [family for family in CONFORMANCE_FAMILIES
                if any((family, mode) in results for mode in (*MODES, PACKED))]
    print("| family | unpatched: collected / passed / failed / skipped | patched: collected / passed / failed / "
          "skipped | pass unpatched, not patched | packed row |")
    print("|---|---|---|---|---|")
    regressions, both_failed, otherwise, stale, odd, skips = [], [], [], [], [], Counter()
    unbuildable, packed_failures = [], []
    for family in families:
        plain, patched = results.get((family, "Unpatched"), {}), results.get((family, "Patched"), {})
        packed, packed_detail = results.get((family, PACKED), {}).get("test_packed_row_matches_batch_rows",
                                                                      ("not run", ""))
        if packed == "failed":
            packed_failures.append(f"{family}: {packed_detail}")
        broken = plain.get(UNBUILDABLE) or patched.get(UNBUILDABLE)
        if broken is not None:
            unbuildable.append(broken[1])
            print(f"| {family} | not built | not built | - | {packed} |")
            continue
        cells = []
        for mode in (plain, patched):
            count = Counter(outcome for outcome, _ in mode.values())
            cells.append(f"{len(mode)} / {count['passed']} / {count['failed'] + count['xfailed']} / "
                         f"{count['skipped']}")
        lost = 0
        for test in sorted(set(plain) | set(patched)):
            (p, p_detail), (q, q_detail) = plain.get(test, ("missing", "")), patched.get(test, ("missing", ""))
            failed = {"failed", "xfailed"}
            reason = reason_for(family, test)
            if p == "passed" and q != "passed":
                lost += 1
                regressions.append(f"{family}: {test} [{q}] {q_detail}")
            elif p in failed and q in failed:
                both_failed.append(f"{family}: {test}: {reason or 'NOT LISTED in known_both_modes.py'}"
                                   f"  [{p_detail}]")
                ok &= reason is not None
            elif p == "skipped" and q == "skipped":
                skips[p_detail] += 1
            elif p != q:
                odd.append(f"{family}: {test}: unpatched {p} [{p_detail}], patched {q} [{q_detail}]")
            for mode, outcome, detail in (("unpatched", p, p_detail), ("patched", q, q_detail)):
                if outcome in failed and LISTED_OTHERWISE in detail:
                    otherwise.append(f"{family}: {test} ({mode}): {detail}")
            if reason is not None and not (p in failed and q in failed) and "missing" not in (p, q):
                stale.append(f"{family}: {test}: listed ({reason}) but unpatched {p}, patched {q}")
        print(f"| {family} | {cells[0]} | {cells[1]} | {lost} | {packed} |")
    uncovered = [tests["test_family_has_a_tiny_config"][1] for (_, mode), tests in results.items()
                 if mode == COVERAGE and tests["test_family_has_a_tiny_config"][0] == "failed"]
    ok &= not (regressions or otherwise or stale or unbuildable or packed_failures or uncovered)
    sections = [("Families whose test classes could not be built", unbuildable),
                ("Pass unpatched, not patched (the contract: none)", regressions),
                ("Fail in both modes (expected: listed, strict xfail)", both_failed),
                ("Listed in known_both_modes.py, failed with another exception type or message", otherwise),
                ("Listed in known_both_modes.py but not failing in both modes", stale),
                ("Packed row differs from the batch rows (test_packed_rows.py)", packed_failures),
                ("Supported families (FAMILIES) without a tiny config, so not in the tier", uncovered),
                ("Other differences between the modes", odd),
                ("Skipped in both modes, by reason (tests x families)", [f"{n:4d}  {why}" for why, n in
                                                                          skips.most_common()])]
    for title, lines in sections:
        print(f"\n## {title}: {len(lines)}")
        for line in lines:
            print(f"- {line}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", type=Path, help="report an earlier run's JUnit XML instead of running")
    parser.add_argument("-n", default="2", help="pytest-xdist workers (0: none); default 2")
    parser.add_argument("-k", help="pytest -k expression, e.g. a family's class token: Bamba, Qwen3Next")
    parser.add_argument("--path", nargs="+", default=list(TIER), help=f"the tier's test files (default {TIER})")
    parser.add_argument("--keep", type=Path, help="where to keep the JUnit XML of the run")
    args = parser.parse_args()
    if args.n == "0":
        args.n = None
    if args.junit is not None:
        return 0 if report(outcomes(args.junit)) else 1
    with tempfile.TemporaryDirectory() as tmp:
        junit = args.keep or Path(tmp) / "conformance.xml"
        seconds = run(args, junit)
        ok = report(outcomes(junit))
    print(f"\nwall time: {seconds:.0f} s (pytest -n {args.n or 0}{f' -k {args.k}' if args.k else ''})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
