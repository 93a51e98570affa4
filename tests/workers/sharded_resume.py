"""One rank of the FSDP checkpoint-safety checks in tests/training/test_checkpoint_safety.py (torch.distributed.run).

After ``killed_save.py OUT writing`` killed ``OUT/cut`` inside its step-6 save, on the same two ranks: trains
``OUT/full`` uninterrupted; resumes ``OUT/cut``; then, for each planted file (one rank's run state, DCP's
``.metadata``), copies ``OUT/cut`` with a pickle payload in that file and resumes the copy. Each rank writes what it
saw to ``OUT/rank<r>.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/sharded_resume.py OUT
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid_pack.distributed import end_process_group
from hybrid_pack.errors import InputError
from hybrid_pack.training import TrainConfig, train
from hybrid_pack.training.checkpoint import CHECKPOINT, latest_checkpoint
from tests.workers.killed_save import SETTINGS
from tests.workers.launch import exit_without_finalizing

PLANTED = ("rank1.pt", ".metadata")
"""The files a payload is planted in: rank 1's run state (rank 0 must refuse too), DCP's metadata (every rank)."""


class Payload:
    """Unpickled, it would create ``marker``: what a checkpoint from an untrusted writer could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(run: Path, file: str, marker: Path) -> Path:
    """The file ``file`` of ``run``'s latest checkpoint, overwritten with a :class:`Payload` in that file's format
    (``torch.save``'s for a ``.pt`` file, a bare pickle for DCP's ``.metadata``)."""
    target = latest_checkpoint(run / CHECKPOINT) / file
    if target.suffix == ".pt":
        torch.save(Payload(marker), target)
    else:
        target.write_bytes(pickle.dumps(Payload(marker)))
    return target


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    seen: dict = {"full": train(TrainConfig(out=str(out / "full"), fsdp=True, **SETTINGS))["losses"]}
    seen["resumed_from"] = latest_checkpoint(out / "cut" / CHECKPOINT).name
    dist.barrier()
    seen["resumed"] = train(TrainConfig(out=str(out / "cut"), fsdp=True, resume=True, **SETTINGS))["losses"]
    seen["left"] = sorted(path.name for path in (out / "cut" / CHECKPOINT).iterdir())
    seen["refusals"] = {}
    for file in PLANTED:
        copy = out / f"planted{file}"
        if rank == 0:
            shutil.copytree(out / "cut", copy)
            plant(copy, file, out / f"marker{file}")
        dist.barrier()
        try:
            train(TrainConfig(out=str(copy), fsdp=True, resume=True, **SETTINGS))
            seen["refusals"][file] = None
        except InputError as err:
            seen["refusals"][file] = str(err)
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    end_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    exit_without_finalizing(0)
