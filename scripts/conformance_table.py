"""The conformance tier's table (docs/api.md §6a): transformers' common model tests per family, unpatched and patched.

Runs ``tests/conformance/test_hf_model_tester.py`` once with ``HYBRID_PACK_CONFORMANCE_RAW=1`` (no expected-
failure marks: every test's real outcome, both modes in the same run), then prints per family the tests
collected / passed / failed / skipped in each mode, every test that passes unpatched but not patched (the
contract: none) with the first line of its patched error, every test failing in both modes with its reason
from ``tests/conformance/known_both_modes.py`` (or ``NOT LISTED``), the entries of that list that no longer
fail in both modes, and the tests skipped in both modes grouped by skip reason.

Usage (from the repository root)::

    .venv/bin/python scripts/conformance_table.py                 # the whole tier, pytest -n 2
    .venv/bin/python scripts/conformance_table.py -k Bamba -n 0   # one family
    .venv/bin/python scripts/conformance_table.py --junit R.xml   # an earlier run's JUnit XML (no run)

Exit status: 0 when the contract holds and the list of both-mode failures is exact, 1 otherwise.
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

from hybrid_pack.integrations.transformers.tiny import TINY_CONFIGS  # noqa: E402
from tests.conformance.known_both_modes import reason_for  # noqa: E402

TIER = "tests/conformance/test_hf_model_tester.py"
MODES = ("Unpatched", "Patched")
CLASS = re.compile(r"\.TestHF(?P<family>\w+?)(?P<mode>Unpatched|Patched)$")
FAMILIES = {"".join(part.title() for part in family.split("_")): family for family in TINY_CONFIGS}
RANK = {"failed": 3, "passed": 2, "xfailed": 1, "skipped": 0}


def first_line(text: str | None) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0][:200] if lines else ""


def outcomes(junit: Path) -> dict[tuple[str, str], dict[str, tuple[str, str]]]:
    """``{(family, mode): {test: (outcome, first line of its error or skip reason)}}``; a test reported more
    than once (subtests) takes its worst outcome."""
    results: dict[tuple[str, str], dict[str, tuple[str, str]]] = defaultdict(dict)
    for case in ET.parse(junit).getroot().iter("testcase"):
        match = CLASS.search(case.get("classname", ""))
        if match is None or match["family"] not in FAMILIES:
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
        bucket = results[(FAMILIES[match["family"]], match["mode"])]
        name = case.get("name", "")
        if name not in bucket or RANK[outcome] > RANK[bucket[name][0]]:
            bucket[name] = (outcome, detail)
    return results


def run(args: argparse.Namespace, junit: Path) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings", str(args.path),
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
    families = [family for family in TINY_CONFIGS if any((family, mode) in results for mode in MODES)]
    print("| family | unpatched: collected / passed / failed / skipped | patched: collected / passed / failed / "
          "skipped | pass unpatched, not patched |")
    print("|---|---|---|---|")
    regressions, both_failed, stale, odd, skips = [], [], [], [], Counter()
    for family in families:
        plain, patched = results.get((family, "Unpatched"), {}), results.get((family, "Patched"), {})
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
            if reason is not None and not (p in failed and q in failed) and "missing" not in (p, q):
                stale.append(f"{family}: {test}: listed ({reason}) but unpatched {p}, patched {q}")
        print(f"| {family} | {cells[0]} | {cells[1]} | {lost} |")
    ok &= not regressions and not stale
    sections = [("Pass unpatched, not patched (the contract: none)", regressions),
                ("Fail in both modes (expected: listed, strict xfail)", both_failed),
                ("Listed in known_both_modes.py but not failing in both modes", stale),
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
    parser.add_argument("--path", default=TIER, help=f"the tier's test file (default {TIER})")
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
