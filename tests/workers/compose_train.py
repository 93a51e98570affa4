"""One rank of the composition proofs in tests/parallel/test_compose.py (run by torch.distributed.run, gloo, 4 ranks).

``train(TrainConfig(...))`` on ``qwen3-next-tiny``, 2 replicas x 2 context-parallel ranks, four times in one
launch, each into its own ``OUT/<run>``: ``fsdp_cp`` (FSDP2 over the flattened mesh, a DCP checkpoint every two
steps); ``resumed`` (the same, stopped right after the checkpoint of step 2, as a crash once it is written, then
resumed from it); ``cp`` (context parallelism with DDP, no FSDP); ``fsdp_cp_ac`` (FSDP2, context parallelism and
activation checkpointing). Then the gradient cases (:func:`gradient_cases`): one optimizer step of the training
loop with FSDP2 over the flattened mesh and context parallelism, with and without activation checkpointing,
against one process's gradient; each rank writes its verdict to ``OUT/gradients.rank<r>.json``.

The process group is this worker's: it ends it with ``end_process_group`` and then exits normally (no
``os._exit``), so the test sees any abort at exit in the launch's stderr.

    python -m torch.distributed.run --nproc_per_node 4 tests/workers/compose_train.py OUT
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybrid_pack.collate import PackingCollator
from hybrid_pack.distributed import end_process_group
from hybrid_pack.modeling import from_preset
from hybrid_pack.parallel import context_parallel_mesh, parallelize
from hybrid_pack.parallel.activation_checkpointing import is_checkpointed
from hybrid_pack.schema import LABELS
from hybrid_pack.training import TrainConfig, sharded, train
from hybrid_pack.training.loop import _optimizer_step, count_targets
from hybrid_pack.training.stats import RunStats
from hybrid_pack.training.trainer import _PackedSteps

RANKS, CONTEXT_PARALLEL = 4, 2
SETTINGS = {"model": "qwen3-next-tiny", "max_examples": 12, "capacity": 128, "overflow": "split", "max_steps": 4,
            "checkpoint_every": 2, "guard_every": 0, "progress": False, "warmup_steps": 1, "lr": 1e-4,
            "context_parallel": CONTEXT_PARALLEL}
"""Tiny and short: 128-token rows of split chats (several documents a row, some crossing the rank edge), four
steps. A small learning rate keeps Adam's rounding differences (the ranks sum in another order) under 1e-5."""

RUNS = {"fsdp_cp": {"fsdp": True}, "cp": {}, "fsdp_cp_ac": {"fsdp": True, "activation_checkpointing": True}}


class Stop(Exception):
    """Raised after the checkpoint of step 2."""


@contextlib.contextmanager
def stop_after_step_two() -> Iterator[None]:
    save = sharded.save_sharded_checkpoint

    def save_then_stop(path, model, optimizer, scheduler, sampler, step, stats) -> None:
        save(path, model, optimizer, scheduler, sampler, step, stats)
        if step == 2:
            raise Stop

    sharded.save_sharded_checkpoint = save_then_stop
    try:
        yield
    except Stop:
        pass
    finally:
        sharded.save_sharded_checkpoint = save


def gradient_cases(out: str) -> None:
    """The gradient of one optimizer step through the training loop (SGD at learning rate 1, no clipping: the
    parameters move by exactly minus the gradient), parallelized with FSDP2 over the flattened mesh and context
    parallelism, with and without activation checkpointing, against one process's gradient of both replicas'
    rows with the loss over their summed targets. Each rank writes the largest differences it sees."""
    mesh = context_parallel_mesh(CONTEXT_PARALLEL, "cpu")
    torch.manual_seed(0)
    reference = from_preset("qwen3-next-tiny")
    parallelized = {"fsdp_cp": copy.deepcopy(reference), "fsdp_cp_ac": copy.deepcopy(reference)}
    rows = [_row(replica) for replica in range(RANKS // CONTEXT_PARALLEL)]  # the same on every rank
    targets = sum(count_targets({LABELS: row[LABELS]}) for row in rows)
    expected_loss = 0.0
    for row in rows:
        loss = reference(**row, num_items_in_batch=torch.tensor(targets)).loss
        loss.backward()
        expected_loss += float(loss)
    expected = {name: p.grad for name, p in reference.named_parameters()}
    cfg = TrainConfig(max_grad_norm=1e9, context_parallel=CONTEXT_PARALLEL)
    steps = _PackedSteps([], None, 1, 1, [], PackingCollator(), mesh.get_group("cp"), CONTEXT_PARALLEL)
    micro_batch = steps._micro_batch(rows[mesh.get_local_rank("dp")])
    verdict, gradients = {}, {}
    for case, model in parallelized.items():
        parallelize(model, mesh=mesh, fsdp=True, activation_checkpointing=case.endswith("_ac"))
        before = {name: p.full_tensor().clone() for name, p in _named(model)}
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        loss = _optimizer_step(model, [micro_batch], optimizer, scheduler, cfg, torch.device("cpu"),
                               contextlib.nullcontext(), dist.get_world_size(), RunStats())
        gradients[case] = {name: before[name] - p.full_tensor() for name, p in _named(model)}
        verdict[case] = {
            "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
            "wrapped": any(is_checkpointed(m) for m in model.modules()),
            "loss_difference": abs(float(loss) - expected_loss),
            "max_gradient_difference": max(float((gradients[case][n] - g).abs().max()) for n, g in expected.items()),
            "gradient_norm": float(sum(g.double().square().sum() for g in expected.values()) ** 0.5),
            "same_names": sorted(gradients[case]) == sorted(expected),
        }
    verdict["checkpointed_against_plain"] = max(float((gradients["fsdp_cp_ac"][n] - g).abs().max())
                                                for n, g in gradients["fsdp_cp"].items())
    with open(os.path.join(out, f"gradients.rank{dist.get_rank()}.json"), "w") as f:
        json.dump(verdict, f)


def _row(replica: int) -> dict[str, torch.Tensor]:
    """One packed row of random documents (120 tokens; some cross the context-parallel rank edge)."""
    generator = torch.Generator().manual_seed(1 + replica)
    lengths = [[9, 40, 3, 51, 17], [70, 2, 33, 15]][replica]
    features = [{"input_ids": torch.randint(0, 256, (n,), generator=generator).tolist()} for n in lengths]
    for feature in features:
        feature["labels"] = list(feature["input_ids"])
    return PackingCollator()(features)


def _named(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters under their unwrapped names (the checkpoint wrapper's prefix removed)."""
    for name, parameter in model.named_parameters():
        yield name.replace("._checkpoint_wrapped_module", ""), parameter


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    for run, options in RUNS.items():
        train(TrainConfig(out=os.path.join(out, run), **SETTINGS, **options))
    with stop_after_step_two():
        train(TrainConfig(out=os.path.join(out, "resumed"), **SETTINGS, **RUNS["fsdp_cp"]))
    train(TrainConfig(out=os.path.join(out, "resumed"), resume=True, **SETTINGS, **RUNS["fsdp_cp"]))
    gradient_cases(out)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
