"""The real-kernel tier: fla and mamba-ssm Triton kernels on CPU under ``TRITON_INTERPRET=1``.

Run it as its own process, ``TRITON_INTERPRET=1 pytest -m kernels tests/kernels`` (``make
test-kernels``): the variable must be set before the kernel packages are imported. Without it, or
without the packages (``scripts/install_kernels_cpu.sh``), every test here is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from hybrid_pack.ops.dispatch.selector import VERIFY_ENV

PACKAGES = ("triton", "fla", "mamba_ssm", "causal_conv1d")
HERE = Path(__file__).parent


def _skip_reason() -> str:
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "real-kernel tier: run as `TRITON_INTERPRET=1 pytest -m kernels tests/kernels` (make test-kernels)"
    missing = [name for name in PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        return f"real-kernel tier: {', '.join(missing)} not installed (scripts/install_kernels_cpu.sh .venv)"
    return ""


SKIP_REASON = _skip_reason()
if SKIP_REASON and os.environ.get("HYBRID_PACK_REQUIRE_KERNELS") == "1":
    raise pytest.UsageError(f"HYBRID_PACK_REQUIRE_KERNELS=1 but the tier cannot run: {SKIP_REASON}")

if not SKIP_REASON:
    from tests.kernels.triton_cpu import enable_cpu_interpreter

    enable_cpu_interpreter()


@pytest.fixture
def without_selfcheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adapter tests compare each kernel with the torch backend themselves; in the interpreter the self-check
    would repeat that comparison at several minutes per signature (tests/ops/test_selfcheck.py tests it)."""
    monkeypatch.setenv(VERIFY_ENV, "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not SKIP_REASON:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)
