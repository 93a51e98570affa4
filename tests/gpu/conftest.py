"""The GPU tier (``make test-gpu``): every kernel at real sizes, every model and a training run on CUDA.

Without a CUDA device every test here is skipped with the reason; CI runs on CPU and never reaches
this tier. With ``HYBRID_PACK_GPU_RESULTS=path.json`` the kernel checks also write what they measured
(backend, signature, max error, seconds) there, for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybrid_pack.ops.selfcheck.kept import environment

HERE = Path(__file__).parent
SKIP_REASON = ("GPU tier: needs a CUDA device (torch.cuda.is_available() is False here); "
               "run `make test-gpu` on a GPU machine")
RESULTS_ENV = "HYBRID_PACK_GPU_RESULTS"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(item.fspath).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="session")
def measured() -> Iterator[list[dict[str, Any]]]:
    """Records of what the tier measured; written to ``$HYBRID_PACK_GPU_RESULTS`` at the end when set."""
    records: list[dict[str, Any]] = []
    yield records
    path = os.environ.get(RESULTS_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if path and worker:  # one file per xdist worker: gpu_results.json -> gpu_results.gw0.json
        path = str(Path(path).with_suffix(f".{worker}{Path(path).suffix}"))
    if path and records:
        device = {"device": torch.cuda.get_device_name()}
        Path(path).write_text(json.dumps({"environment": {**device, **environment()}, "records": records}, indent=1))
