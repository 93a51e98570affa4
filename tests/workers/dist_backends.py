"""One rank of the one-backend-per-op check in tests/ops/test_backend_agreement.py (run by torch.distributed.run).

Two planted CPU backends, registered on every rank: ``conv`` is the pure-torch kernel on rank 0 but 1% off on
rank 1 (its self-check fails there only); ``attention`` is the pure-torch kernel on both (it passes on both).
Each rank keeps its self-check results in its own directory (ranks on different machines share nothing) and
runs one training step of ``qwen3-next-tiny`` sharded with FSDP2. Writes which backend each op ran and the
report to ``OUT.rank<r>.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/dist_backends.py OUT
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid_pack import PackedBoundaries, backends
from hybrid_pack.modeling import from_preset
from hybrid_pack.ops.dispatch.registry import reference_of
from hybrid_pack.parallel.fsdp import apply_fsdp
from tests import kit

PLANTED = "planted"


def main(out: str) -> None:
    rank = int(os.environ["RANK"])
    os.environ["HYBRID_PACK_CACHE"] = f"{out}.cache{rank}"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    conv = reference_of("conv").fn
    backends.register("conv", PLANTED, kit.with_defect(conv, "one_percent_off") if rank == 1 else conv,
                      priority=100, devices=("cpu",), dtypes=(torch.float32,))
    backends.register("attention", PLANTED, reference_of("attention").fn, priority=100, devices=("cpu",),
                      dtypes=(torch.float32,))
    torch.manual_seed(0)
    model = apply_fsdp(from_preset("qwen3-next-tiny"), torch.distributed.device_mesh.init_device_mesh("cpu", (2,)))
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(rank))
    boundaries = PackedBoundaries.from_lengths([7, 20 + rank, 13 - rank])
    model(input_ids=ids, labels=ids, boundaries=boundaries).loss.backward()
    ran = {d.op: {"backend": d.backend, "refused": dict(d.refused)} for d in backends.decisions()}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"ran": ran, "report": backends.report(device="cpu")}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
