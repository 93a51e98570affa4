"""One rank of the FSDP2 training checks in tests/training/test_fsdp.py (run by torch.distributed.run).

``train(TrainConfig(fsdp=True, ...))`` on ``qwen3-next-tiny`` with the guard checking every call and a sharded
checkpoint every two steps, three times in one launch: uninterrupted into ``OUT/full``; into ``OUT/resumed``
stopped right after the checkpoint of step 2 (as a crash would, once it is written); then resumed from it.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/dist_fsdp_train.py OUT
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator

import torch.distributed as dist

from hybrid_pack.distributed import end_process_group
from hybrid_pack.training import TrainConfig, sharded, train
from tests.workers.launch import exit_without_finalizing

SETTINGS = {"max_examples": 32, "capacity": 512, "max_steps": 4, "guard_every": 1, "checkpoint_every": 2,
            "progress": False, "fsdp": True, "warmup_steps": 1, "lr": 1e-4,
            "overflow": "truncate"}
"""A small learning rate: Adam turns a rounding difference in a near-zero gradient (the ranks' reduction sums in
another order than one process) into a step of up to ``lr``; at 1e-4 that stays within the 1e-5 compared."""


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


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    train(TrainConfig(out=os.path.join(out, "full"), **SETTINGS))
    with stop_after_step_two():
        train(TrainConfig(out=os.path.join(out, "resumed"), **SETTINGS))
    train(TrainConfig(out=os.path.join(out, "resumed"), resume=True, **SETTINGS))
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
