"""The self-check a kernel passes before it serves a call (docs/api.md §5a), on one packed row of an adversarial
layout with inputs of the call's signature: outputs against the pure-torch backend in float64 (with gradients, the
outputs of a call without them too) and in the reference's dtypes, each document packed against alone and, with
gradients, gradients against the reference's (``GRADIENT_FACTOR`` times the tolerance) and none crossing segments.
Anything the backend raises fails the check."""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.isolation import (
    GRADIENT_FACTOR,
    Layout,
    Mismatch,
    assert_gradient_inside,
    compare,
    self_check_tolerance,
    selfcheck_layout,
)
from hybrid_pack.ops.selfcheck.contract import (
    CheckCase,
    OpContract,
    Signature,
    dtype_name,
    projection_weights,
    signature_text,
)
from hybrid_pack.ops.selfcheck.result import CheckResult, Implementation, device_name

__all__ = ["run_check", "run_check_apart"]


def _loss(tokens: list[torch.Tensor], states: list[torch.Tensor], token_weights: list[torch.Tensor],
          state_weights: list[torch.Tensor], span: slice = slice(None), rows: slice = slice(None)) -> torch.Tensor:
    """Weighted sum of the token outputs in ``span`` and the document states in ``rows``."""
    return sum((t[:, span].double() * w[:, span]).sum() for t, w in zip(tokens, token_weights)) + sum(
        (s[rows].double() * w[rows]).sum() for s, w in zip(states, state_weights))


def _gradients(loss: torch.Tensor, args: dict[str, object], names: Sequence[str]) -> list[torch.Tensor]:
    tensors = [args[name] for name in names]
    grads = torch.autograd.grad(loss, tensors, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]


def _same_dtypes(outputs: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Each output (per-token outputs, then final states) in the dtype the pure-torch backend returns for the
    call's own inputs (the op's contract, e.g. ``o`` in ``v``'s dtype, states in float32); raises
    :class:`~hybrid_pack.isolation.Mismatch`."""
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        if got.dtype != want.dtype:
            raise Mismatch(f"output {i} is {got.dtype}, expected {want.dtype} (the pure-torch backend's on these "
                           "inputs)", what=f"output {i}'s dtype", error=float("inf"), tolerance=0.0)


def _check(case: CheckCase, boundaries: PackedBoundaries, generator: torch.Generator, backend: Implementation,
           reference: Implementation, contract: OpContract, requires_grad: bool) -> float:
    """Run the three checks; return the largest error seen or raise :class:`~hybrid_pack.isolation.Mismatch`."""
    tolerance = self_check_tolerance([case.precision()])
    grad_names = case.floats() if requires_grad else []
    args = case.leaves(grad_names)
    ref_args = case.leaves(grad_names, float64=True)
    with torch.set_grad_enabled(requires_grad):
        tokens, states = contract.outputs(case.call(backend.fn, boundaries, args))
        ref_tokens, ref_states = contract.outputs(case.call(reference.fn, boundaries, ref_args))
    worst = compare("against the pure-torch backend", tokens + states, ref_tokens + ref_states, tolerance)
    with torch.no_grad():
        own_tokens, own_states = contract.outputs(case.call(reference.fn, boundaries, case.leaves([])))
        _same_dtypes(tokens + states, own_tokens + own_states)
        if requires_grad:  # its verdict serves calls without gradients too, which may take a path of their own
            plain_tokens, plain_states = contract.outputs(case.call(backend.fn, boundaries, case.leaves([])))
            worst = max(worst, compare("without gradients, against the pure-torch backend",
                                       plain_tokens + plain_states, ref_tokens + ref_states, tolerance))

    starts = boundaries.starts
    with torch.no_grad():
        for doc, length in enumerate(boundaries.document_lengths):
            span, rows = slice(starts[doc], starts[doc] + length), slice(doc, doc + 1)
            alone_tokens, alone_states = contract.outputs(case.call(
                backend.fn, PackedBoundaries.from_lengths([length], device=boundaries.device),
                case.sliced(args, span, rows)))
            packed = [t[:, span] for t in tokens] + [s[rows] for s in states]
            worst = max(worst, compare(f"document {doc} ({length} tokens) packed against alone", packed,
                                       alone_tokens + alone_states, tolerance))
    if not requires_grad:
        return worst

    token_weights, state_weights = projection_weights(tokens, generator), projection_weights(states, generator)
    crossing = [n for n in grad_names if n in case.token_inputs or n in case.document_inputs]
    for segment, length in enumerate(boundaries.segment_lengths):
        span, rows = slice(starts[segment], starts[segment] + length), slice(segment, segment + 1)
        own_states = states if segment < boundaries.num_docs else []  # the padding segment has no state
        loss = _loss(tokens, own_states, token_weights, state_weights, span, rows)
        for name, grad in zip(crossing, _gradients(loss, args, crossing)):
            what = f"gradient of segment {segment} ({length} tokens) reaches other segments' {name}"
            if name in case.token_inputs:
                assert_gradient_inside(what, grad, span, dim=1)
            else:
                assert_gradient_inside(what, grad, rows, dim=0)
    # after the leak check: a gradient that crosses segments is named as such, not as a difference
    grads = _gradients(_loss(tokens, states, token_weights, state_weights), args, grad_names)
    ref_grads = _gradients(_loss(ref_tokens, ref_states, token_weights, state_weights), ref_args, grad_names)
    return max(worst, compare("against the pure-torch backend", grads, ref_grads, GRADIENT_FACTOR * tolerance,
                              names=[f"gradient of {name}" for name in grad_names]))


def run_check(backend: Implementation, reference: Implementation, contract: OpContract, signature: Signature,
              device: torch.device, requires_grad: bool, *, layout: Layout | None = None) -> CheckResult:
    """Check ``backend`` for calls of ``signature`` on ``device`` (with backward if ``requires_grad``); ``layout``
    replaces the short row. Raises torch.cuda.OutOfMemoryError (no verdict on the kernel)."""
    began = time.perf_counter()
    layout = layout or selfcheck_layout(contract.edge(signature), contract.reach(signature))
    boundaries = layout.boundaries(device)
    generator = torch.Generator().manual_seed(0)
    case = contract.make_case(signature, boundaries, generator)
    worst, reason = float("nan"), ""
    try:
        worst = (contract.check or _check)(case, boundaries, generator, backend, reference, contract, requires_grad)
    except Mismatch as failure:
        worst, reason = failure.error, f"failed its self-check: {failure}"
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:
        message = str(err).strip().splitlines()
        reason = f"raised {type(err).__name__} in its self-check: {message[0][:300] if message else ''}"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return CheckResult(op=backend.op, backend=backend.name, ok=not reason, reason=reason, max_error=worst,
                       seconds=time.perf_counter() - began, device=device_name(device),
                       dtype=dtype_name(case.precision()), signature=signature_text(signature),
                       requires_grad=requires_grad)


def run_check_apart(backend: Implementation, reference: Implementation, contract: OpContract, signature: Signature,
                    device: torch.device, requires_grad: bool) -> tuple[CheckResult, bool]:
    """:func:`run_check` on a thread of its own (the caller's grad mode, autocast, hooks and dispatch modes do not
    reach it; it takes the caller's CUDA device). ``(result, keep)``: a check that ran out of memory fails, but is no
    verdict on the kernel to keep on disk."""
    index = (torch.cuda.current_device() if device.index is None else device.index) if device.type == "cuda" else None

    def target() -> CheckResult:
        if index is not None:
            torch.cuda.set_device(index)
        return run_check(backend, reference, contract, signature, device, requires_grad)

    with ThreadPoolExecutor(1, thread_name_prefix="hybrid_pack-selfcheck") as thread:
        future = thread.submit(target)
    try:
        return future.result(), True
    except torch.cuda.OutOfMemoryError as error:
        return CheckResult(backend.op, backend.name, False, f"ran out of memory in its self-check ({error})",
                           float("nan"), 0.0, device_name(device), signature=signature_text(signature),
                           requires_grad=requires_grad), False
