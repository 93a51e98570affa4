"""Under the zigzag layout a relayouted op call takes one round of messages in and one out, forward and backward,
however many per-token tensors it has (docs/parallel.md); the pure-torch Gated DeltaNet path widens only the
first segment's values.

One torchrun launch per group size (2 and 4 gloo processes) runs tests/workers/cp_relayout_rounds.py; every rank
reports its rounds (calls of ``torch.distributed.batch_isend_irecv``) per op call, the float64 error of the
gathered output and gradients against the unsharded op, an exchange of four dtypes together, and the
single-device calls of the Gated DeltaNet path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.workers.cp_relayout_rounds import RELAYOUTED
from tests.workers.launch import torchrun

WORKER = Path(__file__).parents[1] / "workers" / "cp_relayout_rounds.py"
TOLERANCE = 1e-10


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}_ranks")
def ranks(request, tmp_path_factory) -> list[dict]:
    """Every rank's results of one launch of the worker on ``param`` processes."""
    out = tmp_path_factory.mktemp("cp_relayout_rounds") / "out"
    torchrun(WORKER, str(out), processes=request.param)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(request.param)]


@pytest.mark.distributed
@pytest.mark.parametrize("op", RELAYOUTED)
def test_one_round_in_and_one_out_forward_and_backward(ranks, op):
    for rank, results in enumerate(ranks):
        counted = results[op]
        assert counted["per_token_inputs"] >= 4, counted
        assert (counted["forward"], counted["backward"]) == (2, 2), f"rank {rank}: {counted}"
        assert counted["worst_error"] <= TOLERANCE, f"rank {rank}: {counted}"


@pytest.mark.distributed
def test_tensors_of_four_dtypes_move_together_exactly(ranks):
    for rank, results in enumerate(ranks):
        mixed = results["mixed_dtypes"]
        assert (mixed["forward"], mixed["back"], mixed["backward"]) == (1, 1, 1), f"rank {rank}: {mixed}"
        assert mixed["values_exact"] and mixed["values_back_exact"] and mixed["gradients_exact"], mixed
        assert mixed["dtypes"] == ["torch.float64", "torch.float32", "torch.bfloat16", "torch.int64"]


@pytest.mark.distributed
def test_gated_delta_widens_only_a_continuing_first_segment(ranks):
    """Values widened by K (5 + 6 = 11 columns) over the first segment alone where it continues from the previous
    rank, the other segments in one plain call; one plain call over the whole slice elsewhere."""
    continuing = 0
    for rank, results in enumerate(ranks):
        report = results["gated_delta_calls"]
        calls = [tuple(call) for call in report["calls"]]
        if report["continues"]:
            continuing += 1
            rest = report["tokens"] - report["first_segment"]
            assert calls == [(report["first_segment"], 11)] + ([(rest, 5)] if rest else []), f"rank {rank}: {report}"
        else:
            assert calls == [(report["tokens"], 5)], f"rank {rank}: {report}"
    assert continuing, "no rank continues a document from the previous one: the layout tests nothing"
