"""Packed RL trainers on several ranks: as many model forwards on every rank in each log-probability call, no hang
(with the packing guard on, every call checked), and one step equal to one process on the same global batch.

The worker (tests/workers/trl_rl_ranks.py) runs one ``PackedGRPOTrainer`` step under torchrun, two gloo ranks
(accelerate's multi-CPU DDP), rank 0's prompt and completions short (one row of 64 tokens per call), rank 1's long
(three rows); then the same step in one process holding the whole global batch. ``PackedDPOTrainer`` packs each
of TRL's calls into one row, so its forwards agree across ranks by construction: its worker
(tests/workers/trl_dpo_ranks.py) checks that, and the step against one process, with ranks whose pairs differ in
length, in the default packing and in ``batch_invariant`` mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.workers.launch import torchrun

pytest.importorskip("trl", reason="TRL is not installed (pip install 'hybrid_pack[trl]')")

WORKER = "trl_rl_ranks.py"
DPO_WORKER = "trl_dpo_ranks.py"


def _run(out: Path, processes: int) -> list[dict[str, Any]]:
    torchrun(WORKER, str(out), processes=processes, timeout=420)
    return [torch.load(f"{out}.rank{r}.pt", weights_only=True) for r in range(processes)]


@pytest.mark.distributed
def test_grpo_ranks_make_equal_forwards_and_one_step_equals_one_process(tmp_path: Path) -> None:
    ranks = _run(tmp_path / "two", 2)
    (alone,) = _run(tmp_path / "one", 1)

    # the old policy's log-probabilities, then the policy's in the loss: the same forwards on both ranks, though
    # rank 1's 134 tokens need three rows of 64 and rank 0's 17 tokens one
    assert ranks[0]["step_forwards"] == ranks[1]["step_forwards"] == [3, 3], [r["step_forwards"] for r in ranks]
    assert alone["step_forwards"] == [3, 3]
    # direct calls, 3 sequences (one without a real token) against 6, then 2 empty sequences against 4
    assert ranks[0]["direct_forwards"] == ranks[1]["direct_forwards"] == [3, 2]
    assert torch.equal(ranks[0]["empty_logps"], torch.zeros(2, 12))

    # the guard (every=1, action="warn") checked every packed call of the step on both ranks, rank 0's padding
    # rows included (one document of two padding tokens each), found no leak, and did not hang
    for rank in ranks:
        assert len(rank["guard_records"]) == 6 and all(record["ok"] for record in rank["guard_records"])
    assert [record["lengths"] for record in ranks[0]["guard_records"][:3]] == [[3, 5, 5], [2], [2]]

    # the loss: TRL's "dapo" normalises each rank's sum by the global token count over the world size, so the
    # ranks' mean is the single process's loss; DDP averages the gradients, which then equal one process's
    # (float32; the packings differ, 1 row + padding rows / 3 rows against 4 rows, so sums run in another order)
    (loss0,), (loss1,) = ranks[0]["losses"], ranks[1]["losses"]
    (loss,) = alone["losses"]
    torch.testing.assert_close((loss0 + loss1) / 2, loss, rtol=0, atol=1e-6)
    assert loss0 != loss1
    grads = alone["grads"]
    assert grads and grads.keys() == ranks[0]["grads"].keys() == ranks[1]["grads"].keys()
    for name, want in grads.items():
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name     # DDP's all-reduce
        torch.testing.assert_close(ranks[0]["grads"][name], want, rtol=0, atol=1e-6, msg=name)
    assert max(g.abs().max().item() for g in grads.values()) > 1e-3                   # the step has gradients


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["default", "invariant"])
def test_dpo_ranks_make_equal_forwards_and_one_step_equals_one_process(tmp_path: Path, mode: str) -> None:
    """PackedDPOTrainer on two ranks whose pairs differ in length (tests/workers/trl_dpo_ranks.py): each call of
    TRL's is one packed row on every rank, so the policy and the reference make one forward each per step on both
    ranks, and the guard (every=1) checks them without hanging. In ``batch_invariant`` mode every row is the static
    row of 128 tokens and every sequence's log-probabilities are bitwise those of one process holding the whole
    global batch; in the default mode they agree to fp32 rounding."""
    torchrun(DPO_WORKER, str(tmp_path / "two"), mode, timeout=420)
    ranks = [torch.load(f"{tmp_path / 'two'}.rank{r}.pt", weights_only=True) for r in range(2)]
    torchrun(DPO_WORKER, str(tmp_path / "one"), mode, processes=1, timeout=420)
    alone = torch.load(f"{tmp_path / 'one'}.rank0.pt", weights_only=True)

    for record in (*ranks, alone):
        assert record["forwards"] == {"policy": 1, "reference": 1}, record["forwards"]
        assert len(record["guard_records"]) == 1 and record["guard_records"][0]["ok"], record["guard_records"]
    rows = [r["shapes"][0] for r in ranks]
    if mode == "invariant":
        assert all(shape == [1, 128] for r in (*ranks, alone) for shape in r["shapes"])
    else:
        assert rows[0] != rows[1], rows                                  # the ranks' rows differ in length

    # every sequence once: rank 0 the short pairs, rank 1 the long ones, one process all of them
    assert not ranks[0]["logps"].keys() & ranks[1]["logps"].keys()
    assert ranks[0]["logps"].keys() | ranks[1]["logps"].keys() == alone["logps"].keys()
    assert max(len(v) for v in ranks[0]["logps"].values()) < min(len(v) for v in ranks[1]["logps"].values())
    for rank in ranks:
        for sequence, logps in rank["logps"].items():
            if mode == "invariant":
                assert torch.equal(logps, alone["logps"][sequence]), sequence
            else:
                torch.testing.assert_close(logps, alone["logps"][sequence], rtol=0, atol=1e-5)

    # the loss: each rank's mean over its pairs, DDP's mean of the gradients: the single process's step
    (loss0,), (loss1,) = ranks[0]["losses"], ranks[1]["losses"]
    torch.testing.assert_close((loss0 + loss1) / 2, alone["losses"][0], rtol=0, atol=1e-6)
    grads = alone["grads"]
    assert grads and grads.keys() == ranks[0]["grads"].keys() == ranks[1]["grads"].keys()
    for name, want in grads.items():
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name     # DDP's all-reduce
        torch.testing.assert_close(ranks[0]["grads"][name], want, rtol=0, atol=1e-6, msg=name)
    assert max(g.abs().max().item() for g in grads.values()) > 1e-4                   # the step has gradients
