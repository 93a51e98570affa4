"""A real two-process torchrun (gloo, CPU) run of PackedBatchSampler + PackingCollator + DDP."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from hybrid_pack.packing import PackedBatchSampler
from tests.workers.launch import torchrun as _torchrun

WORKER = "dist_sampler.py"
TRAINER_WORKER = "hf_trainer.py"
TRAINER_FSDP_WORKER = "hf_trainer_fsdp.py"


@pytest.mark.distributed
def test_two_process_torchrun_sees_every_example_once(tmp_path):
    out = tmp_path / "gathered.json"
    _torchrun(WORKER, str(out))

    record = json.loads(out.read_text())
    ranks = record["ranks"]
    assert record["world_size"] == 2 and len(ranks) == 2
    assert ranks[0]["len"] == ranks[1]["len"] > 0
    for epoch in range(2):
        steps = [r["epochs"][epoch] for r in ranks]
        assert len(steps[0]) == len(steps[1]) == ranks[0]["len"]
        seen = Counter(i for rank_steps in steps for batch in rank_steps for i in batch)
        assert seen == Counter(range(record["num_examples"]))
        assert not {i for b in steps[0] for i in b} & {i for b in steps[1] for i in b}
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]
    assert all(r["resumed_matches"] and r["losses_finite"] for r in ranks)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_process_hf_trainer_gets_each_ranks_steps_and_resumes_exactly(tmp_path):
    """The PackedTrainer of docs/distributed.md: rank r trains on rank r's steps; a mid-epoch resume continues them."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = tmp_path / "run"
    _torchrun(TRAINER_WORKER, str(out))
    full = [json.loads(Path(f"{out}.full.rank{r}.json").read_text()) for r in range(2)]
    settings = full[0]
    steps_per_epoch = len(PackedBatchSampler(settings["lengths"], settings["capacity"], num_replicas=2, rank=0))
    checkpoint = 40
    assert steps_per_epoch < checkpoint < 2 * steps_per_epoch, "the checkpoint must fall inside the second epoch"
    _torchrun(TRAINER_WORKER, str(out), str(out / f"checkpoint-{checkpoint}"))

    for rank in range(2):
        expected = []
        for epoch in range(2):
            sampler = PackedBatchSampler(settings["lengths"], settings["capacity"], num_replicas=2, rank=rank,
                                         seed=settings["seed"])
            sampler.set_epoch(epoch)
            expected += list(sampler)
        assert full[rank]["seen"] == expected
        resumed = json.loads(Path(f"{out}.resumed.rank{rank}.json").read_text())
        assert resumed["seen"] == expected[checkpoint:]


@pytest.mark.distributed
@pytest.mark.slow
def test_packed_trainer_asked_for_fsdp_on_cpu_says_accelerate_does_not_shard_there(tmp_path):
    """accelerate shards only on accelerators; on CPU the Trainer would silently train with DDP instead."""
    pytest.importorskip("accelerate")
    out = tmp_path / "fsdp"
    _torchrun(TRAINER_FSDP_WORKER, str(out))
    for rank in range(2):
        error = json.loads(Path(f"{out}.rank{rank}.json").read_text())["error"]
        assert error is not None and error.startswith("fsdp: asked for, but accelerate did not shard"), error
