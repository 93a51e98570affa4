"""docs/backends.md shows the registry as it is: its matrix is the one the registry renders."""

from __future__ import annotations

from pathlib import Path

from hybrid_pack.backends.matrix import BEGIN, END, markdown_matrix

DOC = Path(__file__).resolve().parents[2] / "docs" / "backends.md"


def test_docs_matrix_is_the_registry() -> None:
    text = DOC.read_text()
    documented = text[text.index(BEGIN):text.index(END) + len(END)]
    assert documented == markdown_matrix(), "regenerate it: python -m hybrid_pack.backends.matrix"


def test_matrix_lists_every_backend_once() -> None:
    from hybrid_pack.backends import OPS, backends_of

    rows = [line for line in markdown_matrix().splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == sum(len(backends_of(op, sharded=None)) for op in OPS)
