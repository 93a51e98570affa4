"""Worker of tests/training/test_training.py: one rank of a torchrun training run, into ``OUT`` (writes its parameter
checksum), then into ``OUT/cut`` stopped on every rank after the checkpoint of step 2 and resumed from it."""

import contextlib
import datetime
import json
import os
import sys

import torch.distributed as dist

from hybrid_pack.distributed import end_process_group
from hybrid_pack.training import TrainConfig, checkpoint, train
from tests.workers.launch import exit_without_finalizing

SETTINGS = {"max_examples": 48, "capacity": 1024, "max_steps": 3, "checkpoint_every": 1, "progress": False}


class Stop(Exception):
    """Raised on every rank after the checkpoint of step 2."""


def save_then_stop(saver: checkpoint.CheckpointSaver, step: int, save=checkpoint.CheckpointSaver.__call__) -> None:
    save(saver, step)
    if step == 2:
        raise Stop


out = sys.argv[1]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))   # one group for the three runs
metrics = train(TrainConfig(out=out, **SETTINGS))
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"checksum": metrics["parameters_checksum"], "losses": metrics["losses"]}, f)
original, checkpoint.CheckpointSaver.__call__ = checkpoint.CheckpointSaver.__call__, save_then_stop
with contextlib.suppress(Stop):
    train(TrainConfig(out=os.path.join(out, "cut"), **SETTINGS))
checkpoint.CheckpointSaver.__call__ = original
train(TrainConfig(out=os.path.join(out, "cut"), resume=True, **SETTINGS))
end_process_group()
exit_without_finalizing(0)
