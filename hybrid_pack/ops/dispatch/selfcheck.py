"""The self-check a kernel passes before it serves a call (docs/api.md §5a).

On one packed row of an adversarial layout (one-token documents, documents ending on the kernel's block edges, a
long one beside short ones, a padding segment) with inputs of the call's signature: (1) its outputs agree with the
pure-torch backend run in float64, within the dtype's tolerance; (2) each document alone gives what it got packed;
(3) with gradients, they agree with the reference's (within ``GRADIENT_FACTOR`` times the tolerance) and no segment's
gradient reaches another segment's inputs. Anything the backend raises fails the check.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.isolation import (
    GRADIENT_FACTOR,
    Layout,
    Mismatch,
    assert_gradient_inside,
    compare,
    least_precise,
    self_check_tolerance,
    selfcheck_layout,
)
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.contract import CheckCase, OpContract, Signature, dtype_name, signature_text
from hybrid_pack.ops.dispatch.verdicts import CheckResult, device_name

__all__ = ["run_check"]


def _precision(case: CheckCase) -> torch.dtype:
    """The least precise floating per-token input dtype: it sets the tolerance."""
    return least_precise(case.arguments[name].dtype for name in case.token_inputs
                         if isinstance(case.arguments.get(name), torch.Tensor))


def _floats(case: CheckCase) -> list[str]:
    return [name for name, value in case.arguments.items()
            if isinstance(value, torch.Tensor) and value.is_floating_point()]


def _prepare(case: CheckCase, names: Sequence[str], *, float64: bool) -> dict[str, object]:
    args: dict[str, object] = {}
    for name, value in case.arguments.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().double() if float64 and value.is_floating_point() else value.detach()
            value = value.clone().requires_grad_(name in names)
        args[name] = value
    return args


def _loss(tokens: list[torch.Tensor], documents: list[torch.Tensor], token_weights: list[torch.Tensor],
          document_weights: list[torch.Tensor], span: slice = slice(None), document: int | None = None
          ) -> torch.Tensor:
    """Weighted sum of the outputs: tokens in ``span`` and, with ``document``, that document's state."""
    loss = sum((t[:, span].double() * w[:, span]).sum() for t, w in zip(tokens, token_weights))
    rows = slice(None) if document is None else slice(document, document + 1)
    if document is not None or span == slice(None):
        loss = loss + sum((d[rows].double() * w[rows]).sum() for d, w in zip(documents, document_weights))
    return loss


def _gradients(loss: torch.Tensor, args: dict[str, object], names: Sequence[str]) -> list[torch.Tensor]:
    tensors = [args[name] for name in names]
    grads = torch.autograd.grad(loss, tensors, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads)]


def _check(case: CheckCase, boundaries: PackedBoundaries, generator: torch.Generator, backend: Backend,
           reference: Backend, contract: OpContract, requires_grad: bool) -> float:
    """Run the three checks; return the largest error seen or raise :class:`~hybrid_pack.isolation.Mismatch`."""
    documents, device = boundaries.document_lengths, boundaries.device
    tolerance = self_check_tolerance([_precision(case)])
    grad_names = _floats(case) if requires_grad else []

    args = _prepare(case, grad_names, float64=False)
    ref_args = _prepare(case, grad_names, float64=True)
    with torch.set_grad_enabled(requires_grad):
        tokens, states = contract.outputs(case.call(backend.fn, boundaries, args))
        ref_tokens, ref_states = contract.outputs(case.call(reference.fn, boundaries, ref_args))
    worst = compare("against the pure-torch backend", tokens + states, ref_tokens + ref_states, tolerance)

    starts = boundaries.starts
    with torch.no_grad():
        for doc, length in enumerate(documents):
            span = slice(starts[doc], starts[doc] + length)
            alone = {name: value if value is None else value[:, span] if name in case.token_inputs else
                     value[doc:doc + 1] if name in case.document_inputs else value for name, value in args.items()}
            alone_tokens, alone_states = contract.outputs(
                case.call(backend.fn, PackedBoundaries.from_lengths([length], device=device), alone))
            packed = [t[:, span] for t in tokens] + [s[doc:doc + 1] for s in states]
            worst = max(worst, compare(f"document {doc} ({length} tokens) packed against alone", packed,
                                       alone_tokens + alone_states, tolerance))
    if not requires_grad:
        return worst

    token_weights = [torch.randn(t.shape, generator=generator, dtype=torch.float64).to(device) for t in tokens]
    state_weights = [torch.randn(s.shape, generator=generator, dtype=torch.float64).to(device) for s in states]
    crossing = [n for n in grad_names if n in case.token_inputs or n in case.document_inputs]
    for segment, length in enumerate(boundaries.segment_lengths):
        span = slice(starts[segment], starts[segment] + length)
        document = segment if segment < boundaries.num_docs else None
        loss = _loss(tokens, states if document is not None else [], token_weights, state_weights, span, document)
        for name, grad in zip(crossing, _gradients(loss, args, crossing)):
            what = f"gradient of segment {segment} ({length} tokens) reaches other segments' {name}"
            if name in case.token_inputs:
                assert_gradient_inside(what, grad, span, dim=1)
            else:
                assert_gradient_inside(what, grad, slice(segment, segment + 1), dim=0)
    # after the leak check: a gradient that crosses segments is named as such, not as a difference
    grads = _gradients(_loss(tokens, states, token_weights, state_weights), args, grad_names)
    ref_grads = _gradients(_loss(ref_tokens, ref_states, token_weights, state_weights), ref_args, grad_names)
    return max(worst, compare("against the pure-torch backend", grads, ref_grads, GRADIENT_FACTOR * tolerance,
                              names=[f"gradient of {name}" for name in grad_names]))


def run_check(backend: Backend, reference: Backend, contract: OpContract, signature: Signature,
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
                       dtype=dtype_name(_precision(case)), signature=signature_text(signature),
                       requires_grad=requires_grad)
