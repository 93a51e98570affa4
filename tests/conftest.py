"""Test-session settings: one torch thread per pytest worker (the suite runs under xdist on a
2-core machine; several OpenMP threads per worker only contend), and a fresh results cache for the
backends' self-checks per worker (a verdict kept from an earlier run must never decide a test), and no verdict
settled or backend chosen by one test left for the next (a test may swap the registry's backends)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from hybrid_pack.ops.dispatch import verdicts
from hybrid_pack.ops.selfcheck.kept import CACHE_ENV

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def fresh_backend_check_results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    before = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("backend_checks"))
    yield
    if before is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = before


@pytest.fixture(autouse=True)
def unsettled_backends() -> Iterator[None]:
    yield
    verdicts.SETTLED.clear()
    verdicts.CHOICES.clear()
