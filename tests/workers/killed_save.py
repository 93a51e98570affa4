"""A training run killed with SIGKILL inside the save of step 6's checkpoint (tests/training/test_checkpoint_safety.py).

    python tests/workers/killed_save.py OUT MOMENT                                    one process
    python -m torch.distributed.run --nproc_per_node 2 tests/workers/killed_save.py OUT MOMENT   FSDP, rank 0 killed

``MOMENT`` is where in the save the process dies: ``writing`` (inside ``torch.save`` of a file of
``step-000006.tmp/``, half its bytes written), ``pointing`` (``step-000006/`` complete, ``latest`` about to be
replaced) or ``pruning`` (``latest`` names step 6, the removal of ``step-000002`` half done). The kill is a test's
doing only: this worker wraps ``torch.save``, ``os.replace`` and ``shutil.rmtree`` before it trains.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import sys
from pathlib import Path

import torch

from hybrid_pack.training import TrainConfig, train

SETTINGS = {"model": "bamba-tiny", "max_examples": 24, "capacity": 128, "overflow": "truncate", "max_steps": 8,
            "checkpoint_every": 2, "guard_every": 0, "progress": False, "lr": 1e-3}
"""Eight steps, a checkpoint every two: the kill comes in the third save."""
KILLED_STEP = 6
MOMENTS = ("writing", "pointing", "pruning")


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_inside_the_save(moment: str) -> None:
    """Wrap the calls a save makes so that this process dies at ``moment`` of step ``KILLED_STEP``'s save."""
    staging = f"step-{KILLED_STEP:06d}.tmp"
    save, replace, rmtree = torch.save, os.replace, shutil.rmtree

    def half_written_save(obj, f, *args, **kwargs):
        if moment == "writing" and staging in str(getattr(f, "name", f)):
            whole = io.BytesIO()
            save(obj, whole, *args, **kwargs)
            f.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            f.flush()
            _die()
        return save(obj, f, *args, **kwargs)

    def replace_unless_pointing(src, dst, *args, **kwargs):
        if moment == "pointing" and Path(dst).name == "latest" and Path(src).read_text().strip() == staging[:-4]:
            _die()
        return replace(src, dst, *args, **kwargs)

    def rmtree_half(path, *args, **kwargs):
        if moment == "pruning" and Path(path).name.startswith("step-000002") and Path(path).is_dir():
            files = sorted(p for p in Path(path).rglob("*") if p.is_file())
            files[0].unlink()
            _die()
        return rmtree(path, *args, **kwargs)

    torch.save, os.replace, shutil.rmtree = half_written_save, replace_unless_pointing, rmtree_half


def main(out: str, moment: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0:
        kill_inside_the_save(moment)
    train(TrainConfig(out=out, fsdp=world > 1, **SETTINGS))
    raise SystemExit(f"the run was not killed inside the save of step {KILLED_STEP} ({moment})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
