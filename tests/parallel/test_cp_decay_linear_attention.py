"""Decay linear attention on a row split across 2 and 4 gloo processes equals the unsharded op (docs/api.md §10).

One torchrun launch per group size (tests/workers/cp_decay_linear_attention.py) runs every row of
``tests.workers.cp_recurrent.LAYOUTS`` (a document over four ranks, ranks holding only a document's middle,
documents ending on rank edges, one-token documents at edges, ranks holding only padding, padding across an edge)
in float64 with initial states: the output, the final states of the documents ending on each rank and the gradient
of every input within 1e-10 of the whole row's; the pieces run without state passing differ wherever a document
crosses a rank edge (so the comparison can fail); a loss on one document puts exactly zero gradient on every other
document's inputs on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_pack.parallel import ShardedBoundaries
from tests.workers.cp_recurrent import LAYOUTS
from tests.workers.launch import torchrun

WORKER = Path(__file__).parents[1] / "workers" / "cp_decay_linear_attention.py"
TOLERANCE = 1e-10
EXPECTED = {"output", "final_state", "dq", "dk", "dv", "dg", "dinitial_state", "restarting at rank edges"}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}_ranks")
def ranks(request, tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp_decay_linear_attention") / "out"
    torchrun(WORKER, str(out), processes=request.param)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text())["results"] for r in range(request.param)]


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_equals_unsharded_forward_and_backward(ranks, layout):
    for rank, results in enumerate(ranks):
        errors = results[layout]
        assert set(errors) == EXPECTED
        beyond = {name: e for name, e in errors.items() if name != "restarting at rank edges" and not e <= TOLERANCE}
        assert not beyond, f"rank {rank}: {beyond}"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_without_state_passing_the_comparison_fails(ranks, layout):
    row = LAYOUTS[layout].boundaries()
    for rank, results in enumerate(ranks):
        shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=len(ranks))
        error = results[layout]["restarting at rank edges"]
        assert error > 1e-3 if shard.continues_from_previous else error == 0.0, f"rank {rank}: {error}"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_gradient_crosses_documents_across_ranks(ranks, layout):
    for rank, results in enumerate(ranks):
        isolation = results[f"{layout}/isolation"]
        assert isolation["other_documents"] == 0.0, f"rank {rank}: {isolation}"
    assert max(results[f"{layout}/isolation"]["own_document"] for results in ranks) > 0
