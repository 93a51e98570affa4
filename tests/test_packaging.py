"""The wheel holds every module: ``[tool.setuptools] packages`` is an explicit list, so a folder left out of it
installs without its modules (an editable install, as the tests use, still finds them)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_declared_in_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {path.parent for path in (ROOT / "hybrid_pack").rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(".".join(folder.relative_to(ROOT).parts) for folder in folders
                     if ".".join(folder.relative_to(ROOT).parts) not in declared)
    assert not missing, f"not in [tool.setuptools] packages of pyproject.toml (the wheel would lack them): {missing}"
    assert all((folder / "__init__.py").is_file() for folder in folders)
