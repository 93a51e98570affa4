"""One rank of tests/parallel/test_cp_kda.py: Kimi Delta Attention on a row split across the group.

    python -m torch.distributed.run --nproc_per_node R tests/workers/cp_kda.py OUT

Every rank builds the same row and inputs, runs the unsharded op on the whole row, then its own slice through
:class:`ShardedBoundaries`, and writes ``OUT.rank{r}.json``: for every layout the worst error of each compared
tensor (``|a - e| / (1 + |e|)``) and the largest gradient one document's loss puts on any other document.
"""

from __future__ import annotations

import functools
import json
import sys

import torch
import torch.distributed as dist

from hybrid_pack.distributed import end_process_group
from hybrid_pack.ops import kda
from hybrid_pack.ops.selfcheck.contract import make_signature
from hybrid_pack.ops.selfcheck.sharded_row import rank_arguments
from hybrid_pack.parallel import ShardedBoundaries
from tests.kit import gradients, op_inputs, projection, run
from tests.workers.cp_recurrent import LAYOUTS
from tests.workers.launch import exit_without_finalizing

TORCH = functools.partial(kda, backend="torch")
SIGNATURE = make_signature(H=2, K=6, HV=4, V=5, use_qk_l2norm=True, output_final_state=True, q=torch.float64,
                           k=torch.float64, v=torch.float64, g=torch.float64, beta=torch.float64,
                           initial_state=torch.float64)


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, f"shape {list(actual.shape)} != {list(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).abs() / (1 + e.abs())).max().item() if a.numel() else 0.0


def compare(row, sharded: ShardedBoundaries) -> dict[str, float]:
    """Outputs, final states of the documents ending here and the gradients of one random projection, sharded
    against the unsharded op."""
    case = op_inputs("kda", SIGNATURE, row, seed=0)
    full = run("kda", TORCH, case, row)
    weights = projection(full, seed=1)
    full_grads = gradients(sum((out * weights[name]).sum() for name, out in full.items()), case.arguments)

    lo, hi = sharded.offset, sharded.offset + sharded.local.total_tokens
    first = sharded.first_segment
    ending = [i for i in range(sharded.local.num_docs)
              if i < sharded.local.num_segments - 1 or not sharded.continues_into_next]
    local_args = rank_arguments(case, sharded)
    local = run("kda", TORCH, case, sharded, local_args)
    errors = {"output": _worst(local["output"], full["output"][:, lo:hi])}
    errors["final_state"] = max([_worst(local["final_state"][i], full["final_state"][first + i]) for i in ending],
                                default=0.0)
    loss = (local["output"] * weights["output"][:, lo:hi]).sum()
    loss = loss + sum((local["final_state"][i] * weights["final_state"][first + i]).sum() for i in ending)
    for name, grad in gradients(loss, local_args).items():
        if name[1:] in case.token_inputs:
            errors[name] = _worst(grad, full_grads[name][:, lo:hi])
        else:
            owned = [i for i in range(sharded.local.num_docs) if i or not sharded.continues_from_previous]
            errors[name] = max([_worst(grad[i], full_grads[name][first + i]) for i in owned], default=0.0)
    return errors


def leaked(row, sharded: ShardedBoundaries, document: int) -> float:
    """The largest gradient ``document``'s outputs put on this rank's tokens of any other document (must be 0)."""
    case = op_inputs("kda", SIGNATURE, row, seed=2)
    local_args = rank_arguments(case, sharded)
    out = run("kda", TORCH, case, sharded, local_args)["output"]
    lo, hi = sharded.offset, sharded.offset + sharded.local.total_tokens
    mine = (row.seq_idx[0, lo:hi] == document).to(out.dtype)
    grads = gradients((out * mine.view(1, -1, 1, 1)).sum(), local_args)
    other = 0.0
    for name in case.token_inputs:
        grad = grads[f"d{name}"]
        keep = mine.view(1, -1, *[1] * (grad.dim() - 2)).bool()
        other = max(other, grad.masked_fill(keep, 0).abs().max().item())
    return other


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict] = {}
    for layout in LAYOUTS.values():
        row = layout.boundaries()
        sharded = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world_size)
        longest = max(range(row.num_docs), key=lambda d: row.segment_lengths[d])
        results[layout.name] = compare(row, sharded) | {"leak": leaked(row, sharded, longest)}
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "results": results}, f)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
