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
        assert ("not on rank 1" in why) if rank == 0 else ("not on rank" not in why), why
        assert "verdicts settled for the 2 ranks" in result["report"]


@pytest.mark.distributed
def test_context_parallel_ranks_settle_one_verdict_per_key_at_the_warm_up(tmp_path):
    """Ranks of one sharded row make different local calls. Before ``verify()`` a call a kernel could serve raises
    naming the warm-up (never a silent fallback); after it, a kernel failing its self-check on rank 1 only serves
    neither rank (whole-row and sharded alike), and a sharded kernel passing its collective check serves both."""
    out = tmp_path / "cp"
    torchrun("dist_backends.py", str(out), "cp", timeout=240)
    ranks = [json.loads(out.with_name(f"{out.name}.rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(ranks):
        ran = result["ran"]
        for op, why in ran["unwarmed"].items():
            assert f"{op}: backend" in why and "hybrid_pack.backends.verify(" in why, why
        assert ran["attention"]["backend"] == "planted_sharded", "passed its collective check: it serves both ranks"
        assert ran["gated_delta"]["backend"] == "torch"
        why = ran["gated_delta"]["refused"]["planted"]
        assert ("not on rank 1" in why) if rank == 0 else ("self-check" in why), why
        # the sharded conv failed its collective check on rank 1: the pure-torch path ran on both ranks
        assert ["conv", "torch"] in ran["all"] and ["conv", "planted_sharded"] not in ran["all"], ran["all"]


@pytest.mark.distributed
def test_evaluation_calls_settle_at_the_warm_up_too(tmp_path):
    """Calls without gradients under ``torch.distributed``: a custom loop that warmed up on its training batch
    evaluates with no error, its kernel refused for training refused for evaluation too (the check with gradients
    holds for them); a trainer evaluating before its first training step (``PackedSFTTrainer``, ``PackedDPOTrainer``)
    settles its evaluation calls at a warm-up of their own (never a ``WarmUpError``), and its kernel serves both
    modes after training."""
    out = tmp_path / "evaluation"
    torchrun("dist_backends.py", str(out), "evaluation", timeout=240)
    ranks = [json.loads(out.with_name(f"{out.name}.rank{r}.json").read_text())["ran"] for r in range(2)]
    for result in ranks:
        loop, trainer = result["loop"], result["trainer"]
        assert "error" not in loop and "error" not in trainer, (loop, trainer)
        assert loop["ran"] == {"grad": [], "no_grad": ["torch"]}, loop
        assert loop["refused"] == ["raised RuntimeError in its self-check: planted backward failure"], loop
        assert trainer["ran_first"] == {"grad": [], "no_grad": ["planted"]}, trainer
        assert trainer["ran"] == {"grad": ["planted"], "no_grad": ["planted"]}, trainer
        assert result["dpo"] == {"ran": {"grad": [], "no_grad": ["planted"]}}, result["dpo"]
    assert ranks[0]["trainer"]["first"] == ranks[1]["trainer"]["first"], "the ranks' evaluation loss is gathered"


@pytest.mark.distributed
def test_a_warm_up_on_one_layout_settles_the_calls_of_every_other(tmp_path):
    """The pure-torch context-parallel recurrences make other local calls when a rank edge cuts a document (final
    states, the delta rule's widened values) than when it falls between two: warmed up on one layout, the next
    row raised ``WarmUpError`` under a kernel (the warm-up now meets the calls of every layout)."""
    out = tmp_path / "layouts"
    torchrun("dist_backends.py", str(out), "layouts", timeout=240)
    for rank in range(2):
        ran = json.loads(out.with_name(f"{out.name}.rank{rank}.json").read_text())["ran"]
        assert ran["errors"] == {}, ran["errors"]
        assert ran["ran"] == [[op, "planted"] for op in ("decay_linear_attention", "gated_delta", "kda", "ssd")]


@pytest.mark.distributed
def test_ranks_whose_registries_or_settings_differ_agree_or_all_raise(tmp_path):
    """A sharded backend registered on some ranks only made ``verify()`` run a different number of collectives
    (a hang) or left a key unsettled on one rank (``WarmUpError`` there, the other rank in an exchange); one rank
    with ``HYBRID_PACK_VERIFY=0`` ran a kernel unchecked. Now such a backend serves no rank, the backends every rank
    has are checked on all, and differing settings raise on every rank."""
    out = tmp_path / "registries"
    torchrun("dist_backends.py", str(out), "registries", timeout=240)
    ranks = [json.loads(out.with_name(f"{out.name}.rank{r}.json").read_text())["ran"] for r in range(2)]
    for result in ranks:
        assert ["conv", "planted_sharded"] in result["ran"], result["ran"]
        assert not {backend for _, backend in result["ran"]} & {"rank_0_only", "rank_1_only"}, result["ran"]
        assert result["raised"].startswith("HYBRID_PACK_VERIFY: turns the self-checks off on ranks [1] only")
