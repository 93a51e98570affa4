"""Backends with their own context parallelism prove themselves collectively before they serve (docs/api.md §5a, §10).

A context-parallel backend (flash-linear-attention's ``fla.ops.cp``) exchanges between ranks itself, so
it can only be checked with the whole group at once: every rank runs it and the pure-torch
context-parallel path on the same adversarial row split across the group (one-token documents on
both sides of a rank edge, a document over every rank, a padding segment), compares its slice of the
outputs and of the gradients of one random projection within the dtype's tolerance, and the group
all-reduces the verdict. Every rank therefore takes the same path: the two paths exchange
differently, and ranks that disagreed would wait on each other forever. Verdicts are kept for the
process, keyed by the op, the backend, the group's ranks, the device, the signature and whether
gradients are needed.

A candidate that raises on every rank (an import or a compilation that fails) fails the check on
every rank. One that raises on some ranks only, between two of its own exchanges, leaves the others
waiting in that exchange: no check can recover from that; the process group's timeout ends the job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.dispatch.contract import Signature
from hybrid_pack.ops.dispatch.registry import contract_of
from hybrid_pack.ops.dispatch.selector import verification_enabled
from hybrid_pack.ops.dispatch.selfcheck import TOLERANCE, relative_error
from hybrid_pack.parallel.boundaries import ShardedBoundaries

__all__ = ["CPBackend", "register_cp_backend", "cp_backends", "adversarial_cp_row", "cp_verdict", "cp_backend_serves",
           "rank_arguments"]

TOKENS_PER_RANK = 128
_VERDICTS: dict[tuple[Any, ...], str] = {}


@dataclass(frozen=True)
class CPBackend:
    """A context-parallel backend of an op, as the backends report lists it.

    Attributes:
        op, name: the op and the backend's name (``backend=name`` forces it on a sharded call).
        device_reason: why it cannot run on a device in this process ("" when it may, pending its collective
            self-check on the group); reads no tensor and starts no collective.
    """

    op: str
    name: str
    device_reason: Callable[[torch.device], str]


_CP_BACKENDS: dict[tuple[str, str], CPBackend] = {}


def register_cp_backend(op: str, name: str, device_reason: Callable[[torch.device], str]) -> None:
    """Declare the context-parallel backend ``name`` of ``op`` (done once, where its adapter is defined)."""
    _CP_BACKENDS[op, name] = CPBackend(op, name, device_reason)


def cp_backends() -> tuple[CPBackend, ...]:
    """Every declared context-parallel backend, in declaration order."""
    return tuple(_CP_BACKENDS.values())


def adversarial_cp_row(world_size: int, device: torch.device | str | None = None) -> PackedBoundaries:
    """``world_size * 128`` tokens: a one-token document ending on the first rank edge and one starting
    there, a document crossing every later edge, a short one, and 26 tokens of padding."""
    per_rank = TOKENS_PER_RANK
    total = world_size * per_rank
    documents = [1, per_rank - 2, 1, 1, total - per_rank - 40, 13]
    return PackedBoundaries.from_document_lengths(documents, num_pad_tokens=total - sum(documents), device=device)


def rank_arguments(case: Any, sharded: ShardedBoundaries) -> dict[str, Any]:
    """This rank's inputs of a check case (fresh leaves, floating ones requiring grad): its slice of every
    per-token tensor, its documents' rows of every per-document tensor, every other tensor shared."""
    lo, hi = sharded.offset, sharded.offset + sharded.total_tokens
    docs = slice(sharded.first_segment, sharded.first_segment + sharded.num_docs)
    local = {}
    for name, value in case.arguments.items():
        if isinstance(value, torch.Tensor):
            value = value[:, lo:hi] if name in case.token_inputs else value[docs] if name in case.document_inputs \
                else value
            value = value.detach().clone().requires_grad_(value.is_floating_point())
        local[name] = value
    return local


def _outputs_and_grads(op: str, fn: Callable[..., Any], case: Any, sharded: ShardedBoundaries,
                       requires_grad: bool) -> list[torch.Tensor]:
    args = rank_arguments(case, sharded)
    tokens, _ = contract_of(op).outputs(case.call(fn, sharded, args))
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.device) for t in tokens]
    if not requires_grad:
        return list(tokens)
    leaves = [v for v in args.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    loss = sum((t.double() * w).sum() for t, w in zip(tokens, weights))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [*tokens, *(torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads))]


def cp_verdict(op: str, name: str, candidate: Callable[..., Any], reference: Callable[..., Any],
               signature: Signature, boundaries: ShardedBoundaries, device: torch.device, requires_grad: bool) -> str:
    """"" when ``candidate`` passed the collective check for this key (run now on first use), else why not.

    A collective: every rank of ``boundaries.group`` must call it for the same key at the same point.

    Args:
        op: the op (its contract makes the inputs of ``signature``).
        name: the candidate backend's name.
        candidate, reference: called as the op (tensors and boundaries positionally, the rest as keywords).
        boundaries: the call's boundaries (only their group matters).
    """
    group = boundaries.group
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    key = (op, name, ranks, str(device), signature, requires_grad)
    if key in _VERDICTS:
        return _VERDICTS[key]
    row = adversarial_cp_row(boundaries.world_size, device)
    sharded = ShardedBoundaries.from_row(row, group=group, rank=boundaries.rank, world_size=boundaries.world_size)
    case = contract_of(op).make_case(signature, row, torch.Generator().manual_seed(0))
    try:
        actual = _outputs_and_grads(op, candidate, case, sharded, requires_grad)
        expected = _outputs_and_grads(op, reference, case, sharded, requires_grad)
        dtypes = [case.arguments[n].dtype for n in case.token_inputs if isinstance(case.arguments.get(n), torch.Tensor)]
        tolerance = max(TOLERANCE.get(d, TOLERANCE[torch.float32]) for d in dtypes)
        errors = [relative_error(a, e) for a, e in zip(actual, expected)]
        worst = max(range(len(errors)), key=lambda i: errors[i])
        reason = "" if errors[worst] <= tolerance else (
            f"context-parallel self-check: output/gradient {worst} differs from the pure-torch path by "
            f"{errors[worst]:.3g} (tolerance {tolerance:.0e})")
    except Exception as error:  # a kernel that raises fails the check; the group still agrees below
        reason = f"context-parallel self-check raised {type(error).__name__}: {error}"
    failed = torch.tensor([1.0 if reason else 0.0], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if failed.item() and not reason:
        reason = "context-parallel self-check failed on another rank of the group"
    _VERDICTS[key] = reason
    return reason


def cp_backend_serves(op: str, name: str, backend: str | None, refusal: Callable[[], str],
                      candidate: Callable[..., Any], reference: Callable[..., Any], signature: Callable[[], Signature],
                      boundaries: ShardedBoundaries, device: torch.device, requires_grad: bool) -> bool:
    """Whether the context-parallel backend ``name`` serves this call of ``op``.

    Never when another ``backend`` is forced; when ``backend`` is ``name`` (forced) or None, it serves if
    ``refusal()`` gives no reason and, unless ``HYBRID_PACK_VERIFY=0``, it passed :func:`cp_verdict`. A forced
    backend that cannot serve raises ``RuntimeError`` with the reason. The answer is the same on every rank as
    long as ``refusal`` reads only what every rank shares (device type, dtypes, sizes, the group) and the ranks
    share one environment (installed packages, GPU model, ``HYBRID_PACK_VERIFY``): a rank that refused while
    the others run the check would leave them waiting in it, so a group of mixed GPUs or environments is not
    supported.
    """
    if backend not in (None, name):
        return False
    reason = refusal()
    if not reason and verification_enabled():
        reason = cp_verdict(op, name, candidate, reference, signature(), boundaries, device, requires_grad)
    if reason and backend == name:
        raise RuntimeError(f"backend {name!r} for {op} cannot run here: {reason}")
    return not reason
