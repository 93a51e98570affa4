"""flash-linear-attention's own context parallelism (GDN and conv) on 2 GPUs over NCCL equals the unsharded op.

fla's CP cannot run on CPU (its collectives need NCCL: gloo rejects the ``[world_size, ...]`` output it
passes to ``all_gather_into_tensor``; its GDN affine chain needs compute capability >= 8.0), so this is
GPU-tier only: one torchrun launch of tests/workers/cp_fla.py on two GPUs, float32, outputs and every
gradient within the self-check's float32 tolerance of the unsharded pure-torch op, on the adversarial
layouts of the CPU proof (tests/parallel/test_cp_recurrent.py).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hybrid_pack.isolation import TOLERANCE
from tests.workers.cp_fla import CASES
from tests.workers.cp_recurrent import LAYOUTS
from tests.workers.launch import torchrun

WORKER = Path(__file__).parents[1] / "workers" / "cp_fla.py"

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason=f"fla's context parallelism needs 2 CUDA GPUs (NCCL takes one rank per GPU); "
                              f"{torch.cuda.device_count()} here"),
    pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention is not installed"),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp_fla") / "out"
    torchrun(WORKER, str(out), processes=2, timeout=900)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text())["results"] for r in range(2)]


@pytest.mark.parametrize("case", [f"{c}/{layout}" for c in CASES for layout in LAYOUTS])
def test_fla_context_parallelism_equals_unsharded(ranks, case):
    for rank, results in enumerate(ranks):
        beyond = {name: e for name, e in results[case].items() if not e <= TOLERANCE[torch.float32]}
        assert not beyond, f"rank {rank}: {beyond}"
