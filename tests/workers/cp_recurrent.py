"""One rank of tests/parallel/test_cp_recurrent.py: Gated DeltaNet and the SSD on a row split across the group.

    python -m torch.distributed.run --nproc_per_node R tests/workers/cp_recurrent.py OUT

Every rank builds the same row and inputs, runs the unsharded op on the whole row, then its own slice
through :class:`ShardedBoundaries`, and writes ``OUT.rank{r}.json``: for every case the worst error of
each compared tensor (``|a - e| / (1 + |e|)``), whether a gradient leaked into another document, and
the messages of the bad-input checks.
"""

from __future__ import annotations

import functools
import json
import sys

import torch
import torch.distributed as dist

from hybrid_pack.distributed import end_process_group
from hybrid_pack.errors import InputError
from hybrid_pack.ops import gated_delta_rule
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import contract_of
from hybrid_pack.ops.selfcheck.sharded_row import cp_check, rank_arguments
from hybrid_pack.parallel import ShardedBoundaries
from tests.kit import (
    Layout,
    gated_delta_signature,
    gradients,
    named,
    op_inputs,
    projection,
    public_op,
    run,
    ssd_signature,
)
from tests.workers.launch import exit_without_finalizing

LAYOUTS = named(
    Layout("spans_four_ranks", (5, 86, 1, 4)),
    Layout("middle_only_ranks", (3, 90, 3)),
    Layout("ends_on_edges", (24, 1, 23, 30, 18)),
    Layout("one_token_docs_at_edges", (23, 1, 1, 22, 1, 1, 30, 1, 1, 15)),
    Layout("padding_only_ranks", (30, 10), num_pad_tokens=56),
    Layout("padding_across_edge", (11, 40), num_pad_tokens=45),
)
"""96 tokens each: 24 per rank on 4 ranks, 48 on 2."""

CASES = {
    "gated_delta": gated_delta_signature(heads=2, v_heads=4, k_dim=6, v_dim=5, initial_state=True),
    "gated_delta_l2norm": gated_delta_signature(heads=2, v_heads=2, k_dim=4, v_dim=3, use_qk_l2norm=True,
                                                output_final_state=False),
    "ssd": ssd_signature(heads=4, head_dim=3, groups=2, state_dim=5, chunk_size=16, D="H", z=True, dt_bias=True,
                         initial_states=True),
    "ssd_plain": ssd_signature(heads=2, head_dim=2, groups=1, state_dim=3, chunk_size=8, dt_softplus=False,
                               return_final_states=False),
}


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, f"shape {list(actual.shape)} != {list(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).abs() / (1 + e.abs())).max().item() if a.numel() else 0.0


def _ending_here(sharded: ShardedBoundaries) -> list[int]:
    """Local documents whose last token is on this rank."""
    return [i for i in range(sharded.local.num_docs)
            if i < sharded.local.num_segments - 1 or not sharded.continues_into_next]


def op_of(case_name: str) -> str:
    """The op a case name starts with."""
    return next(op for op in ("gated_delta", "ssd", "conv") if case_name.startswith(op))


def compare(name: str, signature, row, sharded: ShardedBoundaries, sharded_fn=None) -> dict[str, float]:
    """Outputs, final states and the gradients of one random projection, sharded (through ``sharded_fn``, by
    default the public op's pure-torch backend) against the unsharded pure-torch op."""
    kind = op_of(name)
    fn = public_op(kind)
    sharded_fn = sharded_fn or fn
    case = op_inputs(kind, signature, row, seed=0)
    full = run(kind, fn, case, row)
    weights = {name: w.to(full[name].device) for name, w in projection(full, seed=1).items()}
    full_grads = gradients(sum((out * weights[name]).sum() for name, out in full.items()), case.arguments)

    lo, hi = sharded.offset, sharded.offset + sharded.local.total_tokens
    first, ending = sharded.first_segment, _ending_here(sharded)
    local_args = rank_arguments(case, sharded)
    local = run(kind, sharded_fn, case, sharded, local_args)
    errors = {"output": _worst(local["output"], full["output"][:, lo:hi])}
    loss = (local["output"] * weights["output"][:, lo:hi]).sum()
    if "final_state" in full:
        errors["final_state"] = max([_worst(local["final_state"][i], full["final_state"][first + i])
                                     for i in ending], default=0.0)
        loss = loss + sum((local["final_state"][i] * weights["final_state"][first + i]).sum() for i in ending)
    local_grads = gradients(loss, local_args)
    for name, grad in local_grads.items():
        expected = full_grads[name]
        if name[1:] in case.token_inputs:
            errors[name] = _worst(grad, expected[:, lo:hi])
        elif name[1:] in case.document_inputs:
            owned = [i for i in range(sharded.local.num_docs) if i or not sharded.continues_from_previous]
            errors[name] = max([_worst(grad[i], expected[first + i]) for i in owned], default=0.0)
            if sharded.continues_from_previous and sharded.local.num_docs:
                errors[f"{name} of the continuing document (zero)"] = grad[0].abs().max().item()
        else:  # shared parameters: the group's sum is the row's gradient
            dist.all_reduce(grad)
            errors[name] = _worst(grad, expected)
    return errors


def leaked(name: str, signature, row, sharded: ShardedBoundaries, document: int) -> dict[str, float]:
    """The loss is ``document``'s outputs on every rank; the largest gradient this rank sees on any other
    document's tokens or initial state (must be exactly 0), and the largest on its own (should not be)."""
    kind = op_of(name)
    case = op_inputs(kind, signature, row, seed=2)
    local_args = rank_arguments(case, sharded)
    out = run(kind, public_op(kind), case, sharded, local_args)["output"]
    lo, hi = sharded.offset, sharded.offset + sharded.local.total_tokens
    mine = (row.seq_idx[0, lo:hi] == document).to(out.dtype).view(1, -1, *[1] * (out.dim() - 2))
    grads = gradients((out * mine).sum(), local_args)
    other = own = 0.0
    for name, grad in grads.items():
        if name[1:] in case.token_inputs:
            keep = mine.view(1, -1, *[1] * (grad.dim() - 2)).bool()
            other = max(other, grad.masked_fill(keep, 0).abs().max().item())
            own = max(own, grad.masked_fill(~keep, 0).abs().max().item())
        elif name[1:] in case.document_inputs:
            for i in range(sharded.local.num_docs):
                if sharded.first_segment + i != document:
                    other = max(other, grad[i].abs().max().item())
    return {"other_documents": other, "own_document": own}


def bad_input(row, rank: int, world_size: int) -> dict[str, str]:
    """Boundaries made for a group of another size: the message of the ``InputError``."""
    wrong = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=2 * world_size)
    t = wrong.local.total_tokens
    q = torch.randn(1, t, 1, 4)
    try:
        gated_delta_rule(q, q, torch.randn(1, t, 1, 4), torch.zeros(1, t, 1), torch.ones(1, t, 1), wrong)
    except InputError as error:
        return {"other_group": str(error)}
    return {"other_group": ""}


def collective_check(rank: int, world_size: int) -> dict[str, str]:
    """The sharded backends' collective self-check (:func:`cp_check`) on a sound candidate (the
    pure-torch path itself), one wrong on rank 0 only, and one that raises (on every rank, before any
    exchange, as a kernel that cannot compile does): each rank's verdict."""
    signature = gated_delta_signature(heads=1, v_heads=2, k_dim=4, v_dim=3, output_final_state=False)
    reference = public_op("gated_delta")

    def wrong_on_rank_0(*args, **kwargs):
        o, state = reference(*args, **kwargs)
        return (o * 1.001 if rank == 0 else o), state

    def raises(*args, **kwargs):
        raise RuntimeError("kernel failed to compile")

    candidates = {"sound": reference, "wrong_on_rank_0": wrong_on_rank_0, "raises": raises}
    torch_path = functools.partial(reference, backend="torch")
    return {name: cp_check(Backend("gated_delta", f"test_{name}", fn, priority=0, sharded=True), torch_path,
                           contract_of("gated_delta"), signature, torch.device("cpu"), True, None, rank,
                           world_size).reason
            for name, fn in candidates.items()}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict] = {}
    for layout in LAYOUTS.values():
        row = layout.boundaries()
        sharded = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world_size)
        # The longest document (it crosses the most edges) and the one holding the last rank's first token.
        longest = max(range(row.num_docs), key=lambda d: row.segment_lengths[d])
        last_rank_first = int(row.seq_idx[0, row.total_tokens - row.total_tokens // world_size])
        for name, signature in CASES.items():
            results[f"{name}/{layout.name}"] = compare(name, signature, row, sharded)
            for document in sorted({longest, min(last_rank_first, row.num_docs - 1)}):
                results[f"{name}/{layout.name}/isolation of document {document}"] = leaked(
                    name, signature, row, sharded, document)
    results["collective_check"] = collective_check(rank, world_size)
    results["bad_input"] = bad_input(LAYOUTS["spans_four_ranks"].boundaries(), rank, world_size)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "world_size": world_size, "results": results}, f)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
