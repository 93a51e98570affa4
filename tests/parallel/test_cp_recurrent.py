"""Gated DeltaNet and the SSD on a row split across 2 and 4 gloo processes equal the unsharded op (docs/api.md §10).

One torchrun launch per group size runs every case (tests/workers/cp_recurrent.py): each layout of
``LAYOUTS`` (a document over four ranks, ranks holding only a document's middle, documents ending on
rank edges, one-token documents on both sides of an edge, ranks holding only padding, padding
continuing across an edge) for each signature of ``CASES`` (grouped value heads, initial states,
q/k L2 norm; SSD with D, z, dt_bias and groups). Outputs, final states of the documents ending on a
rank and the gradients of every input, float64, within 1e-10 of the whole row's; a loss on one
document puts exactly zero gradient on every other document's inputs on every rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hybrid_pack.backends import backends_of
from hybrid_pack.errors import BackendUnavailableError, InputError
from hybrid_pack.ops import causal_conv1d, gated_delta_rule
from hybrid_pack.ops.cp.state_passing import state_chain
from hybrid_pack.ops.fla_cp import FLA_CP
from hybrid_pack.parallel import ShardedBoundaries
from tests.kit import Layout
from tests.workers.cp_recurrent import CASES, LAYOUTS
from tests.workers.launch import torchrun

WORKER = Path(__file__).parents[1] / "workers" / "cp_recurrent.py"
TOLERANCE = 1e-10


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}_ranks")
def ranks(request, tmp_path_factory) -> list[dict]:
    """Every rank's results of one launch of the worker on ``param`` processes."""
    out = tmp_path_factory.mktemp("cp_recurrent") / "out"
    torchrun(WORKER, str(out), processes=request.param)
    return [json.loads(Path(f"{out}.rank{r}.json").read_text())["results"] for r in range(request.param)]


@pytest.mark.distributed
@pytest.mark.parametrize("case", [f"{c}/{layout}" for c in CASES for layout in LAYOUTS])
def test_sharded_equals_unsharded_forward_and_backward(ranks, case):
    for rank, results in enumerate(ranks):
        errors = results[case]
        assert "output" in errors and any(name.startswith("d") for name in errors), errors
        beyond = {name: error for name, error in errors.items() if not error <= TOLERANCE}
        assert not beyond, f"rank {rank}: {beyond}"


@pytest.mark.distributed
def test_no_gradient_crosses_documents_across_ranks(ranks):
    isolation = {key for key in ranks[0] if "/isolation of document" in key}
    assert len(isolation) >= len(CASES) * len(LAYOUTS)
    for key in isolation:
        assert all(results[key]["other_documents"] == 0.0 for results in ranks), key
        assert any(results[key]["own_document"] > 0 for results in ranks), f"{key}: no gradient at all"


@pytest.mark.distributed
def test_boundaries_of_another_group_raise_input_error(ranks):
    for results in ranks:
        message = results["bad_input"]["other_group"]
        assert message.startswith("boundaries:") and "shard_batch" in message, message


@pytest.mark.distributed
def test_collective_self_check_passes_sound_fails_wrong_and_the_group_agrees(ranks):
    for rank, results in enumerate(ranks):
        verdicts = results["collective_check"]
        assert verdicts["sound"] == ""
        expected = "differs from the pure-torch path" if rank == 0 else "failed on another rank of the group"
        assert expected in verdicts["wrong_on_rank_0"], verdicts
        assert "raised RuntimeError: kernel failed to compile" in verdicts["raises"], verdicts


@pytest.mark.parametrize("op", ["gated_delta", "conv"])
def test_fla_context_parallelism_is_registered_and_refused_on_cpu_with_the_reason(op):
    """fla's context parallelism is the op's sharded backend in the one registry: on CPU it cannot serve, with the
    reason; the selector then leaves the sharded call to the pure-torch path."""
    (backend,) = backends_of(op, sharded=True)
    assert backend.name == FLA_CP and backend.reason(torch.device("cpu"), torch.float32, True) == \
        "runs on cuda, not cpu"


@pytest.mark.parametrize("op", ["gated_delta", "conv"])
def test_sharded_op_forced_to_fla_cp_on_cpu_raises_the_reason_and_otherwise_runs_the_torch_path(op):
    """The public op on a shard tries fla's context parallelism first (one process, a group of one)."""
    row = LAYOUTS["spans_four_ranks"].boundaries()
    sharded = ShardedBoundaries.from_row(row, group=None, rank=0, world_size=1)
    x = torch.randn(1, row.total_tokens, 2, 4, dtype=torch.float64)
    if op == "gated_delta":
        def run(boundaries, backend=None):
            return gated_delta_rule(x, x, x, -x[..., 0].abs(), x[..., 0].sigmoid(), boundaries, backend=backend)[0]
    else:
        weight = torch.randn(2, 4, dtype=torch.float64)

        def run(boundaries, backend=None):
            return causal_conv1d(x[..., 0], weight, None, boundaries, activation="silu", backend=backend)
    with pytest.raises(BackendUnavailableError, match=f"{op} backend 'fla_cp' .* cannot run here: runs on cuda"):
        run(sharded, FLA_CP)
    torch.testing.assert_close(run(sharded), run(row), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("layout", "world_size", "expected"), [
    (LAYOUTS["spans_four_ranks"], 4, {0: (), 1: (0,), 2: (0, 1), 3: (0, 1, 2)}),
    (LAYOUTS["ends_on_edges"], 4, {0: (), 1: (), 2: (), 3: (2,)}),
    (LAYOUTS["padding_only_ranks"], 4, {0: (), 1: (0,), 2: (1,), 3: (1, 2)}),
    (Layout("no_crossing", (48, 48)), 2, {0: (), 1: ()}),
], ids=lambda x: x.name if isinstance(x, Layout) else None)
def test_state_chain_names_the_ranks_each_incoming_state_folds(layout, world_size, expected):
    row = layout.boundaries()
    chains = {r: state_chain(ShardedBoundaries.from_row(row, group=None, rank=r, world_size=world_size))
              for r in range(world_size)}
    assert {r: chain.sources for r, chain in chains.items()} == expected
    assert all(chain.exchanges == any(expected.values()) for chain in chains.values())


def test_sharded_boundaries_without_a_process_group_raise_input_error():
    row = LAYOUTS["spans_four_ranks"].boundaries()
    sharded = ShardedBoundaries.from_row(row, group=None, rank=1, world_size=2)
    q = torch.randn(1, sharded.local.total_tokens, 1, 4)
    with pytest.raises(InputError, match="boundaries: .*torch.distributed"):
        gated_delta_rule(q, q, q, q[..., 0] * 0, q[..., 0] * 0 + 1, sharded)
