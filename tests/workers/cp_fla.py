"""One rank of tests/gpu/test_cp_fla.py: flash-linear-attention's own context parallelism on CUDA over NCCL.

    python -m torch.distributed.run --nproc_per_node R tests/workers/cp_fla.py OUT

The gated delta rule and the causal conv forced to ``backend="fla_cp"`` (the collective self-check runs
first), each rank's slice against the unsharded pure-torch op on the same row, float32,
on the layouts of tests/workers/cp_recurrent.py. Writes ``OUT.rank{r}.json`` as that worker does.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid_pack.distributed import end_process_group
from hybrid_pack.ops import causal_conv1d, gated_delta_rule
from hybrid_pack.ops.fla_cp import FLA_CP
from hybrid_pack.parallel import ShardedBoundaries
from tests.kit import conv_signature, gated_delta_signature
from tests.workers.cp_recurrent import LAYOUTS, compare
from tests.workers.launch import exit_without_finalizing

CASES = {
    "gated_delta": (gated_delta_signature(heads=2, v_heads=4, k_dim=64, v_dim=64, use_qk_l2norm=True,
                                          output_final_state=False, dtype=torch.float32),
                    functools.partial(gated_delta_rule, backend=FLA_CP)),
    "conv": (conv_signature(channels=64, width=4, activation="silu", dtype=torch.float32),
             functools.partial(causal_conv1d, backend=FLA_CP)),
}


def main(out: str) -> None:
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {}
    for layout in LAYOUTS.values():
        row = layout.boundaries(device)
        sharded = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world_size)
        for name, (signature, fn) in CASES.items():
            results[f"{name}/{layout.name}"] = compare(name, signature, row, sharded, fn)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "results": results}, f)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
