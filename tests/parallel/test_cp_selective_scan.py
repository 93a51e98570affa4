"""Jamba's Mamba-1 selective scan on a row split across 2 and 4 gloo processes equals the unsharded scan
(docs/api.md §10).

One torchrun launch per group size (tests/workers/cp_selective_scan.py) runs every row of
``tests.workers.cp_recurrent.LAYOUTS`` (a document over four ranks, ranks holding only a document's middle,
documents ending on rank edges, one-token documents on both sides of an edge, ranks holding only padding,
padding continuing across an edge), split in the contiguous and the zigzag token layout, in float64: the
output and the gradient of every input (``x, dt, A, B, C, D, z, dt_bias``) within 1e-10 of the whole row's;
the same pieces scanned without state passing differ wherever a segment crosses a rank or chunk edge (so the
comparison can fail); a loss on one segment puts exactly zero gradient on every other segment's tokens on
every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybrid_pack.boundaries.sharded import LAYOUTS as TOKEN_LAYOUTS
from hybrid_pack.errors import InputError
from hybrid_pack.ops.selective_scan import selective_scan
from hybrid_pack.parallel import ShardedBoundaries
from tests.workers import cp_selective_scan as worker
from tests.workers.cp_recurrent import LAYOUTS
from tests.workers.launch import torchrun

TOLERANCE = 1e-10
GRADIENTS = {f"d{name}" for name in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")}
CASES = [f"{row}/{token_layout}" for row in LAYOUTS for token_layout in TOKEN_LAYOUTS]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}_ranks")
def world(request) -> int:
    return request.param


@pytest.fixture(scope="module")
def results(world, tmp_path_factory) -> dict[str, dict]:
    """The results of one launch of the worker on ``world`` processes."""
    out = tmp_path_factory.mktemp("cp_selective_scan") / "results.json"
    torchrun(Path(worker.__file__), str(out), processes=world)
    return json.loads(out.read_text())


def crosses_an_edge(case: str, world: int) -> bool:
    """Whether a segment of the case's row goes on across the edge of a rank's chunk."""
    row, token_layout = case.split("/")
    shard = ShardedBoundaries.from_row(LAYOUTS[row].boundaries(), group=None, rank=0, world_size=world,
                                       layout=token_layout)
    return any(position > 0 for chunks in shard.chunk_first_positions for position in chunks)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_sharded_equals_unsharded_forward_and_backward(results, case):
    errors = {name: error for name, error in results[case].items() if name != "restarting at rank edges"}
    assert set(errors) == {"output"} | GRADIENTS
    beyond = {name: error for name, error in errors.items() if not error <= TOLERANCE}
    assert not beyond, beyond


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_without_state_passing_the_comparison_fails(results, world, case):
    """The rank pieces scanned as documents differ from the row exactly where a segment crosses an edge."""
    error = results[case]["restarting at rank edges"]
    if crosses_an_edge(case, world):
        assert error > 1e-3, error
    else:
        assert error == 0.0, error


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_no_gradient_crosses_documents_across_ranks(results, case):
    segments = results[f"{case}/isolation"]
    assert len(segments) == LAYOUTS[case.split("/")[0]].boundaries().num_segments
    for segment, extremes in segments.items():
        assert extremes["other_documents"] == 0.0, (segment, extremes)
        assert extremes["own_document"] > 0.0, (segment, extremes)


def test_a_group_of_one_is_the_unsharded_scan():
    row = LAYOUTS["spans_four_ranks"].boundaries()
    args = worker.scan_inputs(row, seed=0)
    shard = ShardedBoundaries.from_row(row, group=None, rank=0, world_size=1)
    torch.testing.assert_close(selective_scan(**args, boundaries=shard), selective_scan(**args, boundaries=row),
                               rtol=0, atol=0)


def test_a_shard_without_a_process_group_raises_input_error():
    row = LAYOUTS["spans_four_ranks"].boundaries()
    shard = ShardedBoundaries.from_row(row, group=None, rank=1, world_size=2)
    args = worker.on_rank(worker.scan_inputs(row, seed=0), shard)
    with pytest.raises(InputError, match="boundaries: .*torch.distributed"):
        selective_scan(**args, boundaries=shard)
