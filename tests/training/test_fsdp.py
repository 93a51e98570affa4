"""``hybrid-pack train --fsdp`` on two gloo ranks (docs/distributed.md): FSDP2 training equals one process
training the same global batches, its sharded checkpoint resumes exactly, and the guard checks every call on
every rank."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hybrid_pack.collate import PackingCollator
from hybrid_pack.modeling import HybridForCausalLM
from hybrid_pack.packing import PackedBatchSampler
from hybrid_pack.schema import INPUT_IDS
from hybrid_pack.training import TrainConfig, build_model
from hybrid_pack.training.checkpoint import CHECKPOINT, latest_checkpoint
from hybrid_pack.training.data import build_features, load_chats
from hybrid_pack.training.loop import build_optimizer, train_pass
from hybrid_pack.training.stats import RunStats
from hybrid_pack.training.trainer import _PackedSteps
from tests.workers.dist_fsdp_train import SETTINGS
from tests.workers.launch import torchrun

pytestmark = pytest.mark.distributed
RANKS = 2


def _parameters(run, tmp_path) -> dict[str, torch.Tensor]:
    """The model parameters of a run's last sharded checkpoint, gathered in one process."""
    file = tmp_path / f"{run.name}.pt"
    dcp_to_torch_save(latest_checkpoint(run / CHECKPOINT), file)
    return torch.load(file, weights_only=False)["model"]


def _one_process(cfg: TrainConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, each optimizer step accumulating the rows both ranks trained on at that step."""
    model = build_model(cfg)
    features, _ = build_features(load_chats(cfg.data, cfg.max_examples), model.config.vocab_size,
                                 max_length=cfg.capacity)
    lengths = [len(f[INPUT_IDS]) for f in features]
    sampler = PackedBatchSampler(lengths, cfg.capacity, num_replicas=RANKS, rank=None, seed=cfg.seed)
    total = min(cfg.max_steps, math.ceil(len(sampler) / RANKS) * cfg.epochs)
    optimizer, scheduler = build_optimizer(model, cfg, total)
    steps = _PackedSteps(features, sampler, RANKS, cfg.epochs, [], PackingCollator())
    stats = train_pass(model, steps, total_steps=total, cfg=cfg,
                       device=torch.device("cpu"), autocast=None, world=1, describe="reference",
                       optimizer=optimizer, scheduler=scheduler, stats=RunStats())
    return stats.losses, model.state_dict()


def test_fsdp_training_equals_one_process_resumes_exactly_and_guards_every_rank(tmp_path):
    torchrun("dist_fsdp_train.py", str(tmp_path), timeout=240)
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    metrics = json.loads((full / "metrics.json").read_text())
    assert metrics["world_size"] == RANKS and metrics["fsdp"]["dtype"] == "float32"

    losses, expected = _one_process(TrainConfig(**{**SETTINGS, "fsdp": False}))
    assert metrics["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-5)
    trained = _parameters(full, tmp_path)
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=name)

    saved = HybridForCausalLM.from_pretrained(full / "model").state_dict()  # gathered from the shards on rank 0
    same_shape = [name for name, value in expected.items() if saved[name].shape == value.shape]
    assert len(same_shape) >= len(expected) - 2  # only the embedding and the head are expanded to the tokenizer
    for name in same_shape:
        torch.testing.assert_close(saved[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)

    guard = metrics["guard"]
    assert [r["checks"] for r in guard["ranks"]] == [SETTINGS["max_steps"]] * RANKS
    assert all(record["ok"] and record["rank"] == rank
               for rank, checks in enumerate(guard["ranks"]) for record in checks["records"])
    assert any(len(record["documents"]) > 1 for checks in guard["ranks"] for record in checks["records"])

    assert json.loads((resumed / "metrics.json").read_text())["losses"] == metrics["losses"]
    again = _parameters(resumed, tmp_path)
    for name, value in trained.items():
        assert torch.equal(again[name], value), name
