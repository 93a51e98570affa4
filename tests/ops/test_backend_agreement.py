"""One backend per op on every rank (docs/api.md §5a): a self-check that fails on one rank only keeps the
backend off every rank; one that passes everywhere serves everywhere (two gloo ranks, FSDP2)."""

from __future__ import annotations

import json

import pytest

from tests.workers.launch import torchrun


@pytest.mark.distributed
def test_a_backend_failing_its_self_check_on_rank_1_only_serves_neither_rank(tmp_path):
    out = tmp_path / "backends"
    torchrun("dist_backends.py", str(out), timeout=240)
    ranks = [json.loads(out.with_name(f"{out.name}.rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(ranks):
        ran = result["ran"]
        assert ran["attention"]["backend"] == "planted", "passed on both ranks: it serves both"
        assert ran["conv"]["backend"] == "torch"
        why = ran["conv"]["refused"]["planted"]
        assert ("failed it on rank 1" in why) if rank == 0 else ("failed it on rank" not in why), why
        assert "verdicts agreed across the 2 ranks" in result["report"]


def test_context_parallel_ranks_making_different_calls_choose_backends_without_hanging(tmp_path):
    """Ranks of one sharded row run different local calls: pairing verdicts by call order across ranks could
    hang or mismatch, so each rank keeps its own (the planted kernels pass on both)."""
    out = tmp_path / "cp"
    torchrun("dist_backends.py", str(out), "cp", timeout=240)
    ranks = [json.loads(out.with_name(f"{out.name}.rank{r}.json").read_text()) for r in range(2)]
    assert [result["ran"]["gated_delta"]["backend"] for result in ranks] == ["planted", "planted"]
    assert ranks[0]["ran"]["attention"]["backend"] == "planted"
