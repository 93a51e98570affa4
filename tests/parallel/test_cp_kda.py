"""Kimi Delta Attention on a row split across 2 gloo processes equals the unsharded op (docs/api.md §10).

One torchrun launch runs every layout of tests/workers/cp_recurrent.py (a document over several ranks, ranks
holding only a document's middle, documents ending on rank edges, one-token documents at edges, ranks holding
only padding, padding across an edge) with grouped value heads, initial states and q/k L2 norm: outputs, final
states and the gradients of every input, float64, within 1e-10 of the whole row's; the longest document's loss
puts exactly zero gradient on every other document's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.workers.cp_recurrent import LAYOUTS
from tests.workers.launch import torchrun

WORKER = Path(__file__).parents[1] / "workers" / "cp_kda.py"
TOLERANCE = 1e-10


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp_kda") / "out"
    torchrun(WORKER, str(out), processes=2)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text())["results"] for r in range(2)]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_equals_unsharded_forward_and_backward(ranks, layout):
    for rank, results in enumerate(ranks):
        errors = dict(results[layout])
        assert errors.pop("leak") == 0.0, f"rank {rank}: gradient crosses documents"
        assert {"output", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"} <= set(errors)
        beyond = {name: error for name, error in errors.items() if not error <= TOLERANCE}
        assert not beyond, f"rank {rank}: {beyond}"
