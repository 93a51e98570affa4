"""One rank of tests/parallel/test_cp_selective_scan.py: Jamba's selective scan on a row split across the group.

    python -m torch.distributed.run --nproc_per_node R tests/workers/cp_selective_scan.py OUT

Every rank builds the same float64 row and inputs, runs the scan on the whole row, then on its own part
through :class:`ShardedBoundaries` of each token layout (``contiguous``, ``zigzag``); the parts' outputs and
per-token gradients are gathered over the group and the shared parameters' gradients summed. Rank 0 writes
``OUT`` as JSON, per ``row/layout`` (rows: :data:`tests.workers.cp_recurrent.LAYOUTS`): the
:func:`relative_error` of the output and of every input's gradient; the error of the rank's pieces scanned as
documents (no state passing: what the check must tell apart from the right answer); and per segment the
largest gradient its outputs put on the other segments' tokens (must be exactly 0) and on its own.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from hybrid_pack import PackedBoundaries
from hybrid_pack.boundaries.sharded import LAYOUTS as TOKEN_LAYOUTS
from hybrid_pack.distributed import end_process_group
from hybrid_pack.isolation import relative_error
from hybrid_pack.ops.selective_scan import selective_scan
from hybrid_pack.parallel import ShardedBoundaries
from tests.workers.cp_recurrent import LAYOUTS
from tests.workers.gathered import gather_tokens, summed
from tests.workers.launch import exit_without_finalizing, write_on_rank0

CHANNELS, STATE = 6, 5
TOKEN_INPUTS = ("x", "dt", "B", "C", "z")
"""Inputs with a row per token (``[1, T, ...]``); the others (``A``, ``D``, ``dt_bias``) are shared parameters."""
ScanInputs = dict[str, torch.Tensor]


def scan_inputs(row: PackedBoundaries, seed: int) -> ScanInputs:
    """float64 leaves: ``x, dt, z [1, T, D]``, ``B, C [1, T, N]``, a negative ``A [D, N]``, ``D, dt_bias [D]``."""
    generator = torch.Generator().manual_seed(seed)
    t = row.total_tokens

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    tensors = {"x": draw(1, t, CHANNELS), "dt": draw(1, t, CHANNELS) - 1, "A": -torch.exp(draw(CHANNELS, STATE)),
               "B": draw(1, t, STATE), "C": draw(1, t, STATE), "D": draw(CHANNELS), "z": draw(1, t, CHANNELS),
               "dt_bias": draw(CHANNELS) / 2}
    return {name: value.requires_grad_() for name, value in tensors.items()}


def on_rank(args: ScanInputs, shard: ShardedBoundaries) -> ScanInputs:
    """New leaves: this rank's tokens of the per-token inputs, a copy of the shared ones."""
    return {name: (shard.take(value) if name in TOKEN_INPUTS else value).detach().clone().requires_grad_()
            for name, value in args.items()}


def sharded_against_unsharded(row: PackedBoundaries, shard: ShardedBoundaries) -> dict[str, float]:
    """Relative errors of the gathered output and gradients of one random projection of it."""
    args = scan_inputs(row, seed=0)
    expected = selective_scan(**args, boundaries=row)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    expected_grads = torch.autograd.grad((expected * weight).sum(), list(args.values()))

    local = on_rank(args, shard)
    output = selective_scan(**local, boundaries=shard)
    grads = torch.autograd.grad((output * shard.take(weight)).sum(), list(local.values()))
    errors = {"output": relative_error(gather_tokens(output, shard), expected)}
    for name, grad, want in zip(local, grads, expected_grads, strict=True):
        got = gather_tokens(grad, shard) if name in TOKEN_INPUTS else summed(grad)
        errors[f"d{name}"] = relative_error(got, want)
    with torch.no_grad():
        pieces = selective_scan(**local, boundaries=shard.local)
    errors["restarting at rank edges"] = relative_error(gather_tokens(pieces, shard), expected)
    return errors


def gradient_across_documents(row: PackedBoundaries, shard: ShardedBoundaries) -> dict[str, dict]:
    """For every segment of the row, the loss is its outputs (on every rank): the largest gradient on any other
    segment's tokens (exactly 0 when isolated) and on its own, over the group."""
    args = on_rank(scan_inputs(row, seed=2), shard)
    output = selective_scan(**args, boundaries=shard)
    segment_of = shard.take(row.seq_idx)[0].long()
    result = {}
    for segment in range(row.num_segments):
        mine = (segment_of == segment).view(1, -1, 1)
        grads = torch.autograd.grad((output * mine).sum(), [args[name] for name in TOKEN_INPUTS], retain_graph=True)
        extremes = torch.tensor([max(grad.masked_fill(mine, 0).abs().max().item() for grad in grads),
                                 max(grad.masked_fill(~mine, 0).abs().max().item() for grad in grads)],
                                dtype=torch.float64)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        result[f"segment {segment}"] = {"other_documents": extremes[0].item(), "own_document": extremes[1].item()}
    return result


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a case that hangs fails instead
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, dict] = {}
    for layout in LAYOUTS.values():
        row = layout.boundaries()
        for token_layout in TOKEN_LAYOUTS:
            shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world, layout=token_layout)
            results[f"{layout.name}/{token_layout}"] = sharded_against_unsharded(row, shard)
            results[f"{layout.name}/{token_layout}/isolation"] = gradient_across_documents(row, shard)
    write_on_rank0(out, results)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
