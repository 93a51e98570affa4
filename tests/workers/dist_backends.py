"""One rank of the one-backend-per-op check in tests/ops/test_backend_agreement.py (run by torch.distributed.run).

Two planted CPU backends, registered on every rank: ``conv`` is the pure-torch kernel on rank 0 but 1% off on
rank 1 (its self-check fails there only); ``attention`` is the pure-torch kernel on both (it passes on both).
Each rank keeps its self-check results in its own directory (ranks on different machines share nothing) and
runs one training step of ``qwen3-next-tiny`` sharded with FSDP2. Writes which backend each op ran and the
report to ``OUT.rank<r>.json``.

With ``cp``: planted attention and Gated DeltaNet kernels (the pure-torch ones, so they pass their self-check)
run context-parallel on a row whose second document fills rank 1, so the ranks make different local calls
(rank 1 continues the document: its attention has nothing local to run, its delta rule widens the values).

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/dist_backends.py OUT [cp]
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

from hybrid_pack import PackedBoundaries, backends
from hybrid_pack.distributed import end_process_group, exit_without_finalizing
from hybrid_pack.modeling import from_preset
from hybrid_pack.ops import gated_delta_rule, varlen_attention
from hybrid_pack.ops.dispatch.registry import reference_of
from hybrid_pack.parallel import ShardedBoundaries
from hybrid_pack.parallel.fsdp import apply_fsdp
from tests import kit

PLANTED = "planted"


def main(out: str, mode: str) -> None:
    rank = int(os.environ["RANK"])
    os.environ["HYBRID_PACK_CACHE"] = f"{out}.cache{rank}"
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ran = sharded_ops(rank) if mode == "cp" else fsdp_step(rank)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"ran": ran, "report": backends.report(device="cpu")}, f)
    end_process_group()


def sharded_ops(rank: int) -> dict:
    """Forward and backward of attention and the delta rule on this rank's half of one row; what each ran."""
    for op in ("attention", "gated_delta"):
        backends.register(op, PLANTED, reference_of(op).fn, priority=100, devices=("cpu",), dtypes=(torch.float32,))
    shard = ShardedBoundaries.from_row(PackedBoundaries.from_document_lengths([5, 27]), group=None, rank=rank,
                                       world_size=2)
    generator = torch.Generator().manual_seed(0)
    row = [torch.randn(1, 32, 2, 8, generator=generator) for _ in range(3)]
    row += [-torch.rand(1, 32, 2, generator=generator), torch.rand(1, 32, 2, generator=generator)]
    q, k, v, g, beta = (t[:, shard.offset:shard.offset + 16].clone().requires_grad_() for t in row)
    out, _ = gated_delta_rule(q, k, v, g, beta, shard, use_qk_l2norm=True)
    (out.sum() + varlen_attention(q, k, v, shard).sum()).backward()
    return {d.op: {"backend": d.backend, "refused": dict(d.refused)} for d in backends.decisions()}


def fsdp_step(rank: int) -> dict:
    """One training step of qwen3-next-tiny under FSDP2 with a conv kernel 1% off on rank 1; what each op ran."""
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
    return {d.op: {"backend": d.backend, "refused": dict(d.refused)} for d in backends.decisions()}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "fsdp")
    exit_without_finalizing(0)
