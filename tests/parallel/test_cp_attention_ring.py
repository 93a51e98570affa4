"""Context-parallel attention through the ring passes and each backend's partial form (docs/parallel.md).

``sharded_equals_unsharded``: tests/workers/cp_attention_ring.py on 2 and 4 ranks (gloo), every attention backend
usable here, both layouts, with and without a window, on the adversarial context-parallel row and the
context-parallel proofs' rows: outputs and q/k/v gradients equal the unsharded op's (float64, 1e-10), no gradient
crosses a segment. On the host: the ring's plan bounds the keys and values a rank receives at once to one piece,
and covers every earlier key exactly once; the partial forms' check (the self-check's context-parallel case)
passes the blockwise form's oracle, flex attention's form (forward on CPU), the autograd adapter, and refuses a
planted 0.1 % error.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybrid_pack import PackedBoundaries
from hybrid_pack.boundaries.sharded import LAYOUTS
from hybrid_pack.isolation import Mismatch, adversarial_cp_row
from hybrid_pack.ops.attention import cp
from hybrid_pack.ops.attention.check import check_partial, make_inputs
from hybrid_pack.ops.attention.partial import BLOCKWISE, PartialAttention, from_differentiable
from hybrid_pack.ops.attention.ring import PIECES_PER_CHUNK, ring_plan
from hybrid_pack.ops.dispatch import verdicts as kept
from hybrid_pack.ops.dispatch.selector import resolve
from hybrid_pack.parallel import ShardedBoundaries
from tests.kit import attention_signature
from tests.workers import cp_attention_ring as worker
from tests.workers.launch import launch_once

WORLDS = (2, 4)


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory: pytest.TempPathFactory):
    """``verdicts(world)``: every case's verdict of the one launch on ``world`` ranks (run on first use)."""
    return launch_once(Path(worker.__file__), tmp_path_factory.mktemp, timeout=900)


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS, ids=lambda world: f"{world}ranks")
def test_sharded_attention_equals_unsharded(verdicts, world):
    found = verdicts(world)
    names = found.pop("backends").split(",")
    assert "torch" in names
    assert set(found) == set(worker.cases(world, names)), "a case did not run"
    failed = {case: verdict for case, verdict in found.items() if verdict != "ok"}
    assert not failed, "\n".join(f"{case}: {verdict}" for case, verdict in list(failed.items())[:5])


# ---------------------------------------------------------------- on the host
def _shards(row: PackedBoundaries, world: int, layout: str) -> list[ShardedBoundaries]:
    return [ShardedBoundaries.from_row(row, group=None, rank=r, world_size=world, layout=layout) for r in range(world)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 4, 8])
def test_ring_receives_one_chunk_at_a_time_and_every_earlier_key_once(layout, world):
    for row in (PackedBoundaries.from_lengths([64 * world]), adversarial_cp_row(world)):
        unit = row.total_tokens // (world * (2 if layout == "zigzag" else 1))
        shards = _shards(row, world, layout)
        plans = [ring_plan(shard) for shard in shards]
        assert len({len(plan.passes) for plan in plans}) == 1, "every rank runs the same number of passes"
        for shard, plan in zip(shards, plans, strict=True):
            assert plan.piece_tokens <= -(-unit // PIECES_PER_CHUNK)
            halos = [h for h in shard.chunk_first_positions[shard.rank] if h]
            assert len(plan.heads) == len(halos)
            received = [0] * len(halos)
            for exchange, head in plan.passes:
                tokens = sum(stop - start for _, start, stop in exchange.pieces)
                assert (tokens == 0) == (head is None)
                assert tokens <= -(-unit // PIECES_PER_CHUNK)
                if head is not None:
                    received[head] += tokens
            assert received == halos, "each head receives every earlier key of its document exactly once"


def test_a_document_over_the_whole_row_holds_at_most_a_piece_of_others_keys_at_a_time():
    world, total = 8, 8 * 1024
    plan = ring_plan(_shards(PackedBoundaries.from_lengths([total]), world, "contiguous")[-1])
    assert plan.piece_tokens == total // world // PIECES_PER_CHUNK
    assert len(plan.passes) == (world - 1) * PIECES_PER_CHUNK


def _case(window: int | None = None):
    signature = attention_signature(heads=4, kv_heads=2, dim=8)
    if window is not None:
        signature = tuple(sorted((*signature, ("window", window))))
    row = PackedBoundaries.from_lengths([16])
    return make_inputs(signature, row, torch.Generator().manual_seed(0))


def _dense(q, k, v, *, scale, causal, window=None):
    """Differentiable dense attention of one document (float64 reference for the autograd adapter)."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        distance = torch.arange(q.shape[0])[:, None] + k.shape[0] - q.shape[0] - torch.arange(k.shape[0])[None]
        hidden = (distance < 0) | (distance >= window) if window is not None else distance < 0
        scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v)
    return out, lse.transpose(0, 1)


@pytest.mark.parametrize("window", [None, 7])
def test_partial_check_passes_the_oracle_and_the_autograd_adapter(window):
    generator = torch.Generator().manual_seed(1)
    assert check_partial(BLOCKWISE, _case(window), generator, requires_grad=True) < 1e-12
    assert check_partial(from_differentiable("dense", _dense), _case(window), generator, requires_grad=True) < 1e-12


@pytest.mark.parametrize("window", [None, 7])
def test_flex_partial_form_passes_forward_on_cpu(window):
    from hybrid_pack.ops.attention.kernel_flex import PARTIAL

    assert check_partial(PARTIAL, _case(window), torch.Generator().manual_seed(1), requires_grad=False) < 1e-12


@pytest.mark.parametrize("where", ["output", "gradient"])
def test_partial_check_refuses_a_planted_error(where):
    def forward(q, k, v, **options):
        out, lse = BLOCKWISE.forward(q, k, v, **options)
        return (out * 1.001 if where == "output" else out), lse

    def backward(*args, **options):
        dq, dk, dv = BLOCKWISE.backward(*args, **options)
        return dq, dk * (1.001 if where == "gradient" else 1.0), dv

    planted = PartialAttention("planted", forward, backward)
    with pytest.raises(Mismatch):
        check_partial(planted, _case(), torch.Generator().manual_seed(1), requires_grad=True)


def test_the_partial_form_is_chosen_once_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sharded attention call looks its partial form up; the selector runs once per key, and again after the
    verdicts change (as a route's choice)."""
    resolved = []
    monkeypatch.setattr(cp, "resolve", lambda *args, **kwargs: resolved.append(1) or resolve(*args, **kwargs))
    q, k = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16)
    kept.changed()
    first = cp._partial_form(q, k, k, 0.25, None, None)
    assert cp._partial_form(q, k, k, 0.25, None, None) is first and len(resolved) == 1
    cp._partial_form(q, k, k, 0.25, 4, None)
    assert len(resolved) == 2, "a new window is a new key"
    kept.changed()
    cp._partial_form(q, k, k, 0.25, None, None)
    assert len(resolved) == 3, "a verdict change forgets the choice"
