"""FSDP2 x context parallelism x activation checkpointing composed (docs/parallel.md, issue 27): one ``parallelize``
entry, ``train(TrainConfig(fsdp=True, context_parallel=2, ...))`` on 4 gloo ranks.

The launch (tests/workers/compose_train.py) trains ``qwen3-next-tiny`` on 2 replicas x 2 context-parallel ranks:
FSDP2 over the flattened mesh, the same with DDP instead of FSDP, FSDP2 with activation checkpointing, and a
run stopped after its step-2 checkpoint and resumed; then compares gradient shards with and without activation
checkpointing. The tests below compare those runs with one process training the same global batches.

The same global batches: the trainer's sampler is ``PackedBatchSampler(num_replicas=2, rank=dp)`` (one replica
per context-parallel group; both ranks of a group shard the same row), and with ``grad_accum=1`` replica ``r``'s
optimizer step ``s`` trains the pack ``layout[s, r]``. ``PackedBatchSampler(num_replicas=2, rank=None)`` yields
the packs step-major, ``layout[0, 0], layout[0, 1], layout[1, 0], ...``, so one process accumulating
``grad_accum=2`` rows a step trains both replicas' rows of every step, with the loss over the same target count.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from hybrid_pack import PackedBoundaries
from hybrid_pack.boundaries.sharded import LAYOUTS
from hybrid_pack.collate import PackingCollator
from hybrid_pack.errors import InputError
from hybrid_pack.modeling import HybridForCausalLM, from_preset
from hybrid_pack.packing import PackedBatchSampler
from hybrid_pack.parallel import apply_activation_checkpointing, parallelize
from hybrid_pack.parallel.activation_checkpointing import is_checkpointed
from hybrid_pack.parallel.fsdp import decoder_blocks
from hybrid_pack.schema import INPUT_IDS
from hybrid_pack.training import TrainConfig, build_model
from hybrid_pack.training.data import load_chats, prepare_data
from hybrid_pack.training.loop import build_optimizer, train_pass
from hybrid_pack.training.stats import RunStats
from hybrid_pack.training.trainer import _PackedSteps
from tests.workers import compose_train as worker
from tests.workers.launch import torchrun

REPLICAS = worker.RANKS // worker.CONTEXT_PARALLEL


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The runs' directory and the launch's stderr (every rank exited 0: :func:`torchrun` asserts it)."""
    out = tmp_path_factory.mktemp("compose")
    result = torchrun(Path(worker.__file__).name, str(out), processes=worker.RANKS, timeout=420)
    return out, result.stderr


@pytest.fixture(scope="module")
def one_process() -> tuple[RunStats, torch.nn.Module]:
    """One process training the global batches of the 4-rank runs (the module docstring says how)."""
    cfg = TrainConfig(**{**worker.SETTINGS, "context_parallel": 1, "grad_accum": REPLICAS})
    model = build_model(cfg)
    features = prepare_data(load_chats(cfg.data, cfg.max_examples), model.config.vocab_size, capacity=cfg.capacity,
                            overflow=cfg.overflow).features
    lengths = [len(f[INPUT_IDS]) for f in features]
    sampler = PackedBatchSampler(lengths, cfg.capacity, num_replicas=REPLICAS, rank=None, seed=cfg.seed)
    total = min(cfg.max_steps, math.ceil(len(sampler) / REPLICAS) * cfg.epochs)
    optimizer, scheduler = build_optimizer(model, cfg, total)
    steps = _PackedSteps(features, sampler, REPLICAS, cfg.epochs, [], PackingCollator())
    stats = train_pass(model, steps, total_steps=total, cfg=cfg, device=torch.device("cpu"), autocast=None, world=1,
                       describe="reference", optimizer=optimizer, scheduler=scheduler, stats=RunStats())
    stats.groups = steps.groups
    return stats, model


def _metrics(launch: tuple[Path, str], run: str) -> dict:
    return json.loads((launch[0] / run / "metrics.json").read_text())


@pytest.mark.distributed
def test_every_rank_exits_cleanly(launch):
    """No rank aborts at exit (gloo freeing work after the interpreter began finalizing: end_process_group)."""
    assert "terminate called" not in launch[1], launch[1][-3000:]


def _exported(launch: tuple[Path, str], run: str) -> dict[str, torch.Tensor]:
    """The run's trained weights as saved on rank 0 (gathered from the shards under FSDP)."""
    return HybridForCausalLM.from_pretrained(launch[0] / run / "model").state_dict()


@pytest.mark.distributed
@pytest.mark.parametrize("run", ["fsdp_cp", "cp"])
def test_fsdp_with_context_parallel_trains_as_one_process(launch, one_process, run):
    """Losses of every step (1e-5) and the parameter checksum (1e-6 relative) equal one process's on the same global
    batches; every parameter within 1e-4 of it: Adam turns a rounding difference in a near-zero gradient (the ranks
    sum in another order) into a step of up to ``lr`` (1e-4), so parameter-wise the exact proofs are the gradient
    one below (1e-5) and FSDP against DDP (1e-5)."""
    stats, expected = one_process
    metrics = _metrics(launch, run)
    assert metrics["world_size"] == worker.RANKS and metrics["context_parallel"] == worker.CONTEXT_PARALLEL
    assert ("fsdp" in metrics) == (run == "fsdp_cp")
    assert len(stats.losses) == worker.SETTINGS["max_steps"] >= 3
    assert metrics["losses"] == pytest.approx(stats.losses, rel=1e-5, abs=1e-5)
    reference_sum = sum(float(p.detach().double().sum()) for p in expected.parameters())
    assert metrics["parameters_checksum"] == pytest.approx(reference_sum, rel=1e-6)
    trained, reference = _exported(launch, run), expected.state_dict()
    same_shape = [name for name, value in reference.items() if trained[name].shape == value.shape]
    assert len(same_shape) >= len(reference) - 2  # only the embedding and the head are expanded to the tokenizer
    for name in same_shape:
        torch.testing.assert_close(trained[name], reference[name], rtol=0, atol=worker.SETTINGS["lr"], msg=name)


@pytest.mark.distributed
def test_fsdp_with_context_parallel_equals_context_parallel_with_ddp(launch):
    sharded, replicated = _metrics(launch, "fsdp_cp"), _metrics(launch, "cp")
    assert sharded["losses"] == pytest.approx(replicated["losses"], rel=1e-5, abs=1e-5)
    trained, expected = _exported(launch, "fsdp_cp"), _exported(launch, "cp")
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["fsdp_cp", "fsdp_cp_ac"])
def test_one_step_gradient_through_the_loop_equals_one_process(launch, case):
    """The loop's ``loss * world`` with FSDP2's average over the flattened mesh (4 ranks) gives each parameter the
    one-process gradient of both replicas' rows (SGD at lr 1 moves it by minus its gradient); a reduction over the
    wrong ranks or a missing scale would be off by a factor 2 or 4."""
    for rank in range(worker.RANKS):
        verdict = json.loads((launch[0] / f"gradients.rank{rank}.json").read_text())[case]
        assert verdict["sharded"] and verdict["same_names"] and verdict["wrapped"] == case.endswith("_ac"), verdict
        assert verdict["gradient_norm"] > 0.1, verdict
        assert verdict["loss_difference"] <= 1e-5 and verdict["max_gradient_difference"] <= 1e-5, verdict


@pytest.mark.distributed
def test_fsdp_shards_over_the_flattened_mesh(launch):
    assert _metrics(launch, "fsdp_cp")["fsdp"]["mesh"] == "4 ranks (the dpxcp mesh (2, 2) flattened)"


@pytest.mark.distributed
def test_metrics_count_what_the_steps_trained_once_per_row(launch, one_process):
    """``real_tokens``: every trained row's tokens, once (not rank 0's shard); documents and packs: what was trained."""
    stats, _ = one_process
    metrics = _metrics(launch, "fsdp_cp")
    assert metrics["real_tokens"] == stats.real_tokens
    assert metrics["packs"] == len(stats.groups) == REPLICAS * worker.SETTINGS["max_steps"]
    assert metrics["documents_trained"] == sum(len(group) for group in stats.groups) < metrics["documents"]
    assert metrics["examples"] == worker.SETTINGS["max_examples"]


@pytest.mark.distributed
def test_resume_from_the_sharded_checkpoint_is_exact(launch):
    full, resumed = _metrics(launch, "fsdp_cp"), _metrics(launch, "resumed")
    assert resumed["losses"] == full["losses"] and resumed["final_loss"] == full["final_loss"]
    assert resumed["parameters_checksum"] == full["parameters_checksum"]
    assert resumed["real_tokens"] == full["real_tokens"] and resumed["packs"] == full["packs"]


@pytest.mark.distributed
def test_activation_checkpointing_under_fsdp_and_context_parallel_changes_nothing(launch):
    plain, checkpointed = _metrics(launch, "fsdp_cp"), _metrics(launch, "fsdp_cp_ac")
    assert checkpointed["activation_checkpointing"] and not plain["activation_checkpointing"]
    assert checkpointed["losses"] == pytest.approx(plain["losses"], rel=1e-6, abs=1e-6)
    for rank in range(worker.RANKS):
        verdict = json.loads((launch[0] / f"gradients.rank{rank}.json").read_text())
        assert verdict["checkpointed_against_plain"] <= 1e-6, verdict


# ---------------------------------------------------------------- one process
def _packed_row(vocab_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    features = [{"input_ids": torch.randint(3, vocab_size, (n,), generator=generator).tolist()} for n in (7, 30, 2, 19)]
    for feature in features:
        feature["labels"] = list(feature["input_ids"])
    return PackingCollator()(features)


def _hf(family: str) -> torch.nn.Module:
    pytest.importorskip("transformers")
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model

    model = tiny_model(family)
    if getattr(model.config, "num_experts", 0):
        model.set_experts_implementation("eager")
    return patch_model(model).train()


@pytest.mark.parametrize("make", [lambda: from_preset("qwen3-next-tiny").train(), lambda: _hf("qwen3_next"),
                                  lambda: _hf("jamba")], ids=["qwen3-next-tiny", "hf-qwen3_next", "hf-jamba"])
def test_activation_checkpointing_equals_plain_forward_and_backward(make):
    """Losses and every gradient with every block checkpointed equal the plain model's (1e-6), for a native preset
    and patched Hugging Face models (Jamba's Mamba layers get their boundaries through a hook: it runs in the
    recompute too); the state dict keeps its keys."""
    torch.manual_seed(0)
    plain = make()
    checkpointed = apply_activation_checkpointing(copy.deepcopy(plain))
    assert is_checkpointed(checkpointed) or all(is_checkpointed(block) for block in decoder_blocks(checkpointed))
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    batch = _packed_row(plain.config.vocab_size)
    boundaries = PackedBoundaries.from_batch(batch)
    losses, block_calls = [], []
    for model in (plain, checkpointed):
        calls: list[int] = []
        # A submodule of every block counts the block's runs (transformers checkpoints a layer's forward, inside its
        # hooks, so a hook on the block itself runs once either way).
        firsts = [next(getattr(block, "_checkpoint_wrapped_module", block).children())
                  for block in decoder_blocks(model)]
        hooks = [first.register_forward_hook(lambda *_, calls=calls: calls.append(1)) for first in firsts]
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"], boundaries=boundaries).loss
        loss.backward()
        losses.append(loss.detach())
        block_calls.append(len(calls))
        for hook in hooks:
            hook.remove()
    blocks = len(decoder_blocks(plain))
    assert block_calls == [blocks, 2 * blocks]  # checkpointed: every block ran again in the backward
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    grads = {name.replace("._checkpoint_wrapped_module", ""): p.grad for name, p in checkpointed.named_parameters()}
    assert sum(float(p.grad.abs().sum()) for p in plain.parameters() if p.grad is not None) > 0
    for name, parameter in plain.named_parameters():
        if parameter.grad is None:  # an expert no token was routed to
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], parameter.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_activation_checkpointing_is_idempotent_and_parallelize_without_a_process_group_refuses_fsdp():
    model = parallelize(from_preset("qwen3-next-tiny"), mesh=None, activation_checkpointing=True)
    wrapped = decoder_blocks(model)
    assert decoder_blocks(apply_activation_checkpointing(model)) == wrapped
    compiled = parallelize(model, mesh=None, compile=True)  # compiled in place (lazily: nothing traced yet)
    assert decoder_blocks(compiled) == wrapped and all(block._compiled_call_impl is not None for block in wrapped)
    with pytest.raises(InputError, match="torchrun"):
        parallelize(from_preset("qwen3-next-tiny"), mesh=None, fsdp=True)


def test_config_composes_fsdp_with_context_parallel_and_activation_checkpointing():
    cfg = TrainConfig(fsdp=True, context_parallel=2, activation_checkpointing=True)
    assert cfg.cp_layout == "contiguous" and cfg.row_multiple == 2
    with pytest.raises(InputError, match="cp_layout"):
        TrainConfig(context_parallel=2, cp_layout="diagonal")


@pytest.mark.skipif("zigzag" not in LAYOUTS, reason="the zigzag layout is not in hybrid_pack.boundaries.sharded yet")
def test_zigzag_rows_are_padded_to_twice_the_context_parallel_size():
    assert TrainConfig(context_parallel=2, cp_layout="zigzag").row_multiple == 4
    assert TrainConfig(context_parallel=1, cp_layout="zigzag").row_multiple == 1
