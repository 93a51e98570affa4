"""One rank of tests/parallel/test_cp_relayout_rounds.py: how many point-to-point rounds a relayouted op call takes.

    python -m torch.distributed.run --nproc_per_node R tests/workers/cp_relayout_rounds.py OUT

Every op that runs on the contiguous layout under the zigzag layout (:data:`RELAYOUTED`) is called on this
rank's zigzag shard of a row whose documents cross rank and chunk edges. Each rank counts its calls of
``torch.distributed.batch_isend_irecv`` (one per round of messages) in the forward and in the backward, and
compares the gathered output and gradients with the unsharded op's (float64). Then tensors of four dtypes go
to the contiguous layout and back with :func:`to_contiguous` / :func:`to_layout`: rounds, and exact values and
gradients. Last, the single-device calls the pure-torch Gated DeltaNet path makes (widened values only over
the first segment). Writes ``OUT.rank{r}.json``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack import PackedBoundaries
from hybrid_pack.distributed import end_process_group
from hybrid_pack.ops import decay_linear_attention, gated_delta_rule, kda, mamba2_ssd
from hybrid_pack.ops.cp.relayout import to_contiguous, to_layout
from hybrid_pack.ops.gated_delta.cp import gated_delta_rule_cp
from hybrid_pack.ops.selective_scan import selective_scan
from hybrid_pack.ops.selfcheck.contract import make_signature
from hybrid_pack.parallel import ShardedBoundaries
from tests.kit import gated_delta_signature, op_inputs, ssd_signature
from tests.workers.cp_selective_scan import TOKEN_INPUTS as SCAN_TOKEN_INPUTS
from tests.workers.cp_selective_scan import scan_inputs
from tests.workers.gathered import gather_tokens, summed
from tests.workers.launch import exit_without_finalizing

ROW = (5, 27, 40, 1, 3, 12)
"""Document lengths of the row (96 tokens with 8 of padding: zigzag chunks of 24 tokens on 2 ranks, 12 on 4)."""

F64 = torch.float64
SIGNATURES = {
    "gated_delta": gated_delta_signature(heads=2, v_heads=4, k_dim=6, v_dim=5, output_final_state=False),
    "kda": make_signature(H=2, K=6, HV=4, V=5, use_qk_l2norm=True, output_final_state=False, q=F64, k=F64, v=F64,
                          g=F64, beta=F64, initial_state=None),
    "decay_linear_attention": make_signature(H=2, K=4, V=3, output_final_state=False, q=F64, k=F64, v=F64, g=F64,
                                             initial_state=None),
    "ssd": ssd_signature(heads=4, head_dim=3, groups=2, state_dim=5, chunk_size=16, D="H", z=True, dt_bias=True,
                         return_final_states=False),
}
PUBLIC = {"gated_delta": gated_delta_rule, "kda": kda, "decay_linear_attention": decay_linear_attention,
          "ssd": mamba2_ssd}
RELAYOUTED = (*SIGNATURES, "selective_scan")
"""The ops whose context-parallel path serves the contiguous layout only."""


@contextlib.contextmanager
def counting_rounds() -> Iterator[list[int]]:
    """``[n]``: the calls of ``torch.distributed.batch_isend_irecv`` (rounds of point-to-point messages) inside."""
    count, original = [0], dist.batch_isend_irecv

    def counted(ops: list[Any]) -> Any:
        count[0] += 1
        return original(ops)

    dist.batch_isend_irecv = counted
    try:
        yield count
    finally:
        dist.batch_isend_irecv = original


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).abs() / (1 + e.abs())).max().item()


def inputs(op: str, row: PackedBoundaries) -> tuple[dict[str, Any], tuple[str, ...], Callable[..., torch.Tensor]]:
    """``(arguments of the whole row, the per-token ones, the op's pure-torch backend returning its output)``."""
    if op == "selective_scan":
        return dict(scan_inputs(row, seed=0)), tuple(SCAN_TOKEN_INPUTS), \
            lambda boundaries, **args: selective_scan(**args, boundaries=boundaries, backend="torch")
    case = op_inputs(op, SIGNATURES[op], row, seed=0)
    fn = functools.partial(PUBLIC[op], backend="torch")

    def output(boundaries: Any, **args: Any) -> torch.Tensor:
        result = case.call(fn, boundaries, args)
        return result[0] if isinstance(result, tuple) else result

    arguments = {name: value for name, value in case.arguments.items() if value is not None}
    return arguments, tuple(case.token_inputs), output


def op_rounds(op: str, row: PackedBoundaries, shard: ShardedBoundaries) -> dict[str, float]:
    """Rounds in this rank's forward and backward of one call, and the worst error against the whole row."""
    arguments, token_inputs, output = inputs(op, row)
    expected = output(row, **arguments)
    weight = torch.randn(expected.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    floating = [name for name, value in arguments.items()
                if isinstance(value, torch.Tensor) and value.is_floating_point()]
    expected_grads = torch.autograd.grad((expected * weight).sum(), [arguments[name] for name in floating])

    local = {name: (shard.take(value) if name in token_inputs else value).detach().clone()
             .requires_grad_(name in floating) if isinstance(value, torch.Tensor) else value
             for name, value in arguments.items()}
    with counting_rounds() as forward:
        out = output(shard, **local)
    with counting_rounds() as backward:
        grads = torch.autograd.grad((out * shard.take(weight)).sum(), [local[name] for name in floating])
    errors = {"output": _worst(gather_tokens(out, shard), expected)}
    for name, grad, want in zip(floating, grads, expected_grads, strict=True):
        errors[f"d{name}"] = _worst(gather_tokens(grad, shard) if name in token_inputs else summed(grad), want)
    return {"forward": forward[0], "backward": backward[0], "per_token_inputs": len(token_inputs),
            "worst_error": max(errors.values())}


def mixed_dtypes(row: PackedBoundaries, shard: ShardedBoundaries) -> dict[str, Any]:
    """float64, float32, bfloat16 and int64 tensors holding their tokens' row positions, to the contiguous layout
    and back in one call each: rounds, and whether values and gradients land exactly where they belong."""
    position = torch.arange(row.total_tokens, dtype=F64).view(1, -1)
    whole = [position.unsqueeze(-1).expand(1, -1, 3) + torch.arange(3, dtype=F64) / 4,
             (position.view(1, -1, 1, 1) + torch.arange(4).view(2, 2) / 8).float(),
             (position / 64).bfloat16(), position.long() * 7]
    local = [shard.take(x).clone().requires_grad_(x.is_floating_point()) for x in whole]
    lo, hi = shard.rank * shard.local.total_tokens, (shard.rank + 1) * shard.local.total_tokens
    with counting_rounds() as there:
        moved = to_contiguous(*local, boundaries=shard)
    with counting_rounds() as back:
        returned = to_layout(*moved, boundaries=shard)
    weights = [torch.randn(x.shape, generator=torch.Generator().manual_seed(i), dtype=F64).to(x.dtype)
               for i, x in enumerate(local[:3])]
    with counting_rounds() as backward:
        grads = torch.autograd.grad(sum((y * w).float().sum() for y, w in zip(moved[:3], weights, strict=True)),
                                    local[:3])
    exact = all(torch.equal(m, x[:, lo:hi]) for m, x in zip(moved, whole, strict=True))
    exact_back = all(torch.equal(r, x) for r, x in zip(returned, local, strict=True))
    # The gradient of each moved token is its weight: back on the rank and position that holds the token.
    gathered_weights = [gather_tokens(w, shard.contiguous()) for w in weights]
    exact_grads = all(torch.equal(g, shard.take(w)) for g, w in zip(grads, gathered_weights, strict=True))
    return {"forward": there[0], "back": back[0], "backward": backward[0], "values_exact": exact,
            "values_back_exact": exact_back, "gradients_exact": exact_grads,
            "dtypes": [str(m.dtype) for m in moved]}


def gated_delta_calls(row: PackedBoundaries, shard: ShardedBoundaries) -> dict[str, Any]:
    """The single-device calls the pure-torch Gated DeltaNet path makes on this rank's contiguous shard:
    ``(tokens, value columns)`` each, beside the first local segment's length and whether it continues."""
    calls: list[tuple[int, int]] = []

    def recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append((v.shape[1], v.shape[3]))
        return gated_delta_rule(q, k, v, *args, **kwargs)

    case = op_inputs("gated_delta", SIGNATURES["gated_delta"], row, seed=0)
    contiguous = shard.contiguous()
    local = {name: contiguous.take(value).detach() if name in case.token_inputs else value
             for name, value in case.arguments.items() if value is not None}
    gated_delta_rule_cp(recorded, local["q"], local["k"], local["v"], local["g"], local["beta"], contiguous,
                        scale=local["scale"], initial_state=None, output_final_state=False,
                        use_qk_l2norm=False, backend="torch")
    return {"calls": calls, "first_segment": contiguous.local.segment_lengths[0],
            "continues": contiguous.continues_from_previous, "tokens": contiguous.local.total_tokens}


def main(out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a case that hangs fails instead
    rank, world = dist.get_rank(), dist.get_world_size()
    row = PackedBoundaries.from_document_lengths(ROW, num_pad_tokens=8)
    shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world, layout="zigzag")
    results: dict[str, Any] = {op: op_rounds(op, row, shard) for op in RELAYOUTED}
    results["mixed_dtypes"] = mixed_dtypes(row, shard)
    results["gated_delta_calls"] = gated_delta_calls(row, shard)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(results, f, indent=1)
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_finalizing(0)
