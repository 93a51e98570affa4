"""One rank of tests/parallel/test_cp_decay_linear_attention.py: decay linear attention on a row split across the
group.

    python -m torch.distributed.run --nproc_per_node R tests/workers/cp_decay_linear_attention.py OUT

Every rank builds the same float64 row and inputs (initial states included), runs the op on the whole row, then its
own slice through :class:`ShardedBoundaries` (contiguous layout), and writes ``OUT.rank{r}.json``: per row of
:data:`tests.workers.cp_recurrent.LAYOUTS` the worst error (``|a - e| / (1 + |e|)``) of the output, of the final
states of the documents ending on this rank and of every input's gradient; the error of the rank's pieces run as
documents (no state passing); and, for a loss on the longest document, the largest gradient on any other document's
inputs (must be exactly 0).
"""

from __future__ import annotations

import functools
import json
import sys

import torch
import torch.distributed as dist

from hybrid_pack.distributed import end_process_group
from hybrid_pack.ops import decay_linear_attention
from hybrid_pack.ops.selfcheck.contract import make_signature
from hybrid_pack.ops.selfcheck.sharded_row import rank_arguments
from hybrid_pack.parallel import ShardedBoundaries
from tests.kit import gradients, op_inputs, projection, run
from tests.workers.cp_recurrent import LAYOUTS, _ending_here, _worst
from tests.workers.launch import exit_without_finalizing

OP = "decay_linear_attention"
TORCH = functools.partial(decay_linear_attention, backend="torch")
SIGNATURE = make_signature(H=2, K=4, V=3, output_final_state=True, q=torch.float64, k=torch.float64,
                           v=torch.float64, g=torch.float64, initial_state=torch.float64)


def compare(row, sharded: ShardedBoundaries) -> dict[str, float]:
    case = op_inputs(OP, SIGNATURE, row, seed=0)
    full = run(OP, TORCH, case, row)
    weights = projection(full, seed=1)
    full_grads = gradients(sum((out * weights[name]).sum() for name, out in full.items()), case.arguments)

    lo, hi = sharded.offset, sharded.offset + sharded.local.total_tokens
    first, ending = sharded.first_segment, _ending_here(sharded)
    local_args = rank_arguments(case, sharded)
    local = run(OP, TORCH, case, sharded, local_args)
    errors = {"output": _worst(local["output"], full["output"][:, lo:hi]),
              "final_state": max([_worst(local["final_state"][i], full["final_state"][first + i]) for i in ending],
                                 default=0.0)}
    loss = (local["output"] * weights["output"][:, lo:hi]).sum()
    loss = loss + sum((local["final_state"][i] * weights["final_state"][first + i]).sum() for i in ending)
    for name, grad in gradients(loss, local_args).items():
        if name[1:] in case.token_inputs:
            errors[name] = _worst(grad, full_grads[name][:, lo:hi])
        else:
            owned = [i for i in range(sharded.local.num_docs) if i or not sharded.continues_from_previous]
            errors[name] = max([_worst(grad[i], full_grads[name][first + i]) for i in owned], default=0.0)

    pieces = run(OP, TORCH, case, sharded.local, {**local_args, "initial_state": None})
    no_state = run(OP, TORCH, case, row, {**case.arguments, "initial_state": None})
    errors["restarting at rank edges"] = _worst(pieces["output"], no_state["output"][:, lo:hi])
    return errors


def leaked(row, sharded: ShardedBoundaries) -> dict[str, float]:
    """Loss on the longest document's outputs on every rank: the largest gradient on other documents' inputs."""
    document = max(range(row.num_docs), key=lambda d: row.segment_lengths[d])
    case = op_inputs(OP, SIGNATURE, row, seed=2)
    local_args = rank_arguments(case, sharded)
    out = run(OP, TORCH, case, sharded, local_args)["output"]
    lo, hi = sharded.offset, sharded.offset + sharded.local.total_tokens
    mine = (row.seq_idx[0, lo:hi] == document).to(out.dtype)
    other = own = 0.0
    for name, grad in gradients((out * mine[None, :, None, None]).sum(), local_args).items():
        if name[1:] in case.token_inputs:
            keep = mine.bool().view(1, -1, *[1] * (grad.dim() - 2))
            other = max(other, grad.masked_fill(keep, 0).abs().max().item())
            own = max(own, grad.masked_fill(~keep, 0).abs().max().item())
        else:
            for i in range(sharded.local.num_docs):
                if sharded.first_segment + i != document:
                    other = max(other, grad[i].abs().max().item())
    return {"other_documents": other, "own_document": own}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict] = {}
    for layout in LAYOUTS.values():
        row = layout.boundaries()
        sharded = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world_size)
        results[layout.name] = compare(row, sharded)
        results[f"{layout.name}/isolation"] = leaked(row, sharded)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "results": results}, f)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
