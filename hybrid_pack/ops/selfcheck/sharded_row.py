"""The collective self-check of a sharded backend (docs/api.md §5a, §10): on one adversarial row split across the
group, each rank compares its slice of the outputs, and of one random projection's gradients, with the op's pure-torch
context-parallel path, and the group agrees on the verdict. Only the warm-up runs it, so every rank takes the same
path; a kernel that raises on some ranks only, between its own exchanges, leaves the others waiting until the process
group's timeout ends the job."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from hybrid_pack.boundaries.sharded import ShardedBoundaries
from hybrid_pack.distributed import agree_max
from hybrid_pack.isolation import GRADIENT_FACTOR, Mismatch, adversarial_cp_row, compare, self_check_tolerance
from hybrid_pack.ops.selfcheck.contract import CheckCase, OpContract, Signature, projection_weights, signature_text
from hybrid_pack.ops.selfcheck.result import CheckResult, Implementation, device_name

__all__ = ["cp_check", "rank_arguments"]


def rank_arguments(case: CheckCase, sharded: ShardedBoundaries) -> dict[str, Any]:
    """This rank's inputs of a check case as fresh leaves: its slice of the per-token and per-document tensors."""
    tokens = slice(sharded.offset, sharded.offset + sharded.local.total_tokens)
    documents = slice(sharded.first_segment, sharded.first_segment + sharded.local.num_docs)
    return case.leaves(case.floats(), case.sliced(case.arguments, tokens, documents))


def _outputs_and_grads(contract: OpContract, fn: Callable[..., Any], case: CheckCase, sharded: ShardedBoundaries,
                       requires_grad: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """This rank's token outputs, and (with ``requires_grad``) the gradients of one random projection of them."""
    args = rank_arguments(case, sharded)
    tokens, _ = contract.outputs(case.call(fn, sharded, args))
    if not requires_grad:
        return list(tokens), []
    weights = projection_weights(tokens, torch.Generator().manual_seed(1))
    leaves = [v for v in args.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    loss = sum((t.double() * w).sum() for t, w in zip(tokens, weights))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return list(tokens), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


def cp_check(backend: Implementation, reference: Callable[..., Any], contract: OpContract, signature: Signature,
             device: torch.device, requires_grad: bool, group: Any, rank: int, world_size: int) -> CheckResult:
    """The self-check of the sharded ``backend`` for this key against ``reference`` (the op's pure-torch
    context-parallel path): collective, every rank of ``group`` calls it."""
    began = time.perf_counter()
    row = adversarial_cp_row(world_size, device)
    sharded = ShardedBoundaries.from_row(row, group=group, rank=rank, world_size=world_size)
    case = contract.make_case(signature, row, torch.Generator().manual_seed(0))
    worst = float("nan")
    try:
        actual, actual_grads = _outputs_and_grads(contract, backend.fn, case, sharded, requires_grad)
        expected, expected_grads = _outputs_and_grads(contract, reference, case, sharded, requires_grad)
        plain = actual
        if requires_grad:  # its verdict serves calls without gradients too, which may take a path of their own
            with torch.no_grad():
                plain, _ = _outputs_and_grads(contract, backend.fn, case, sharded, False)
        # every call above is collective: all run on every rank before any comparison may fail on one of them
        tolerance = self_check_tolerance([case.precision()])
        worst = compare("outputs", actual, expected, tolerance)
        worst = max(worst, compare("gradients", actual_grads, expected_grads, GRADIENT_FACTOR * tolerance))
        worst = max(worst, compare("outputs without gradients", plain, expected, tolerance))
        reason = ""
    except Mismatch as mismatch:
        worst, reason = mismatch.error, (f"context-parallel self-check: {mismatch.what} differs from the pure-torch "
                                         f"path by {mismatch.error:.3g} (tolerance {mismatch.tolerance:.0e})")
    except Exception as error:  # a kernel that raises fails the check; the group still agrees below
        reason = f"context-parallel self-check raised {type(error).__name__}: {error}"
    if agree_max([1.0 if reason else 0.0], group)[0] and not reason:
        reason = "context-parallel self-check failed on another rank of the group"
    return CheckResult(op=backend.op, backend=backend.name, ok=not reason, reason=reason, max_error=worst,
                       seconds=time.perf_counter() - began, device=device_name(device), signature=signature_text(
                           signature), requires_grad=requires_grad)
