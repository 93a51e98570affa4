"""The guard and the harness on an FSDP2-sharded model across two gloo ranks (docs/api.md §7b): ranks whose rows
hold different numbers of documents run the same forwards, and a leak found on one rank stops every rank (fails
the harness's report on every rank), naming it."""

from __future__ import annotations

import json

import pytest

from tests.workers.launch import torchrun

pytestmark = pytest.mark.distributed


def _ranks(out) -> list[dict]:
    return [json.loads(out.with_name(f"{out.name}.rank{r}.json").read_text()) for r in range(2)]


def test_rows_of_one_two_and_six_documents_check_together_without_mismatch(tmp_path):
    out = tmp_path / "uneven"
    torchrun("dist_guard.py", str(out), "uneven", timeout=240)
    for rank, result in enumerate(_ranks(out)):
        assert result["error"] is None
        records = result["records"]
        assert len(records) == 3 and all(r["ok"] and r["rank"] == rank for r in records)
        assert sorted(len(r["documents"]) for r in records) == [1, 2, 3]   # 1, 2 and 6 documents (3 checked)
        harness = result["harness"]
        assert harness["ok"] and harness["error"] is None and harness["documents"] == 1 + 5 * rank


def test_a_leak_seen_on_one_rank_raises_on_every_rank_naming_it(tmp_path):
    out = tmp_path / "leak"
    torchrun("dist_guard.py", str(out), "leak", timeout=240)
    ranks = _ranks(out)
    for rank, result in enumerate(ranks):
        assert result["error"] is not None and "Found on rank 1" in result["error"], result["error"]
        assert result["error"].startswith(f"[rank {rank}]")
        (record,) = result["records"]                  # stopped at the first check
        assert not record["ok"] and record["leak_rank"] == 1
    assert ranks[0]["records"][0]["max_diff"] == 0.0   # rank 0's rows hold one document: nothing to see there
    assert ranks[0]["records"][0]["first_leaking_module"] == ranks[1]["records"][0]["first_leaking_module"]
    for result in ranks:                               # action="warn": every rank warns once, naming rank 1
        (warning,) = result["warnings"]
        assert "Found on rank 1" in warning
    for result in ranks:                               # the harness on a training step: the same verdict
        harness = result["harness"]
        assert not harness["ok"] and harness["leak_rank"] == 1 and harness["error"] is None
    assert ranks[0]["harness"]["module"] == ranks[1]["harness"]["module"]
