"""Every ```python block in README.md and docs/*.md runs as written.

Each block is a complete program: it runs alone, in a fresh interpreter, from a scratch directory.
A block fenced ```python continued carries on from the block before it in the same file; the two
(or more) are run joined, as one program. Signatures, and commands that need torchrun or a GPU, are
fenced as ```text or ```bash, never ```python (docs/architecture.md, "Docs that run").
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(?P<info>[^\n`]*)\n(?P<code>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
CONTINUED = "continued"
BLOCK_TIMEOUT_S = 120
DOC_SITE = ROOT / "tests" / "support" / "doc_site"


@dataclasses.dataclass(frozen=True)
class DocProgram:
    """One program of a page: a ```python block and any ```python continued blocks after it."""

    page: Path
    line: int  # where its first block opens, 1-based
    code: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def doc_programs(page: Path) -> list[DocProgram]:
    """The programs of one page, in order; a continued block with nothing before it is an error."""
    text = page.read_text()
    programs: list[DocProgram] = []
    for fence in FENCE.finditer(text):
        words = fence["info"].split()
        if not words or words[0] != "python":
            continue
        line = text.count("\n", 0, fence.start()) + 1
        if CONTINUED in words[1:]:
            if not programs:
                raise ValueError(f"{page.name}:{line}: a ```python {CONTINUED} block has no block before it")
            last = programs[-1]
            programs[-1] = dataclasses.replace(last, code=last.code + fence["code"])
        else:
            programs.append(DocProgram(page, line, fence["code"]))
    return programs


PROGRAMS = [program for page in PAGES for program in doc_programs(page)]


def test_every_page_is_collected():
    assert {program.page.name for program in PROGRAMS} >= {"README.md", "quickstart.md"}


def test_a_continued_block_joins_the_one_before(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```bash\nls\n```\n\n```python continued\nassert x == 1\n```\n"
                    "\n```python\ny = 2\n```\n")
    first, second = doc_programs(page)
    assert (first.line, first.code, second.code) == (1, "x = 1\nassert x == 1\n", "y = 2\n")


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda program: program.name)
def test_doc_block_runs_as_written(program: DocProgram, tmp_path: Path):
    script = tmp_path / "block.py"
    script.write_text(program.code)
    # The package under test first on the path, and transformers' families on their torch path as the programs
    # would run their kernels on a GPU (tests/support/doc_site); one torch thread, as every test worker runs.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(DOC_SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=BLOCK_TIMEOUT_S, check=False)
    assert result.returncode == 0, f"{program.name} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
