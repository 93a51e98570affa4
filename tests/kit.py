"""What the tests share: packed layouts in one notation, one closeness check, each op's inputs, and the
two proofs every op owes.

* A layout is a :class:`~hybrid_pack.isolation.Layout`: the documents' lengths plus the tokens of a
  trailing padding segment; ``layout.boundaries()`` builds its :class:`PackedBoundaries`. The sets
  below are each op's test rows, named after the geometry they stress (the checks' own generators
  live in :mod:`hybrid_pack.isolation.layouts`).
* :func:`assert_close` is the one tolerance check.
* An op's inputs come from the op's own ``make_inputs`` (``hybrid_pack/ops/<op>/check.py``, the one
  the backends' self-check draws from), for a signature named with the ``*_signature`` helpers here.
* :func:`assert_packed_equals_segments_alone` and :func:`assert_no_gradient_crosses_segments` prove,
  forward and backward, that a packed row never mixes its documents.
* :func:`with_defect` plants one defect into an op's function, for the tests that prove these checks
  (and the backends' self-check) catch it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.isolation import Layout
from hybrid_pack.ops import (
    causal_conv1d,
    decay_linear_attention,
    gated_delta_rule,
    kda,
    mamba2_ssd,
    selective_scan,
    varlen_attention,
)
from hybrid_pack.ops.dispatch.registry import contract_of
from hybrid_pack.ops.gated_delta.torch_backend import CHUNK_SIZE as GATED_DELTA_CHUNK
from hybrid_pack.ops.selfcheck.contract import CheckCase, Signature, make_signature

__all__ = [
    "Layout", "named", "ATTENTION_LAYOUTS", "FLEX_BLOCK_LAYOUTS", "CONV_LAYOUTS", "GATED_DELTA_LAYOUTS",
    "SSD_LAYOUTS", "SSD_LONG_LAYOUT", "KERNEL_LAYOUTS", "MODEL_LAYOUTS",
    "assert_close",
    "CheckCase", "Signature", "OpFn", "PUBLIC_OPS", "public_op",
    "attention_signature", "conv_signature", "gated_delta_signature", "ssd_signature",
    "op_inputs", "segment_spans", "segment_arguments", "run", "projection", "gradients", "forward_backward",
    "assert_packed_equals_segments_alone", "assert_no_gradient_crosses_segments",
    "DEFECTS", "with_defect",
]

OpFn = Callable[..., Any]
"""An op called as :meth:`CheckCase.call` calls it: tensors and boundaries positionally, the rest as keywords."""


# ---------------------------------------------------------------- layouts
def named(*layouts: Layout) -> dict[str, Layout]:
    """Layouts by name (the name is also the test id)."""
    return {layout.name: layout for layout in layouts}


ATTENTION_LAYOUTS = named(
    Layout("one_token_docs", (1, 1, 1, 1, 1)),
    Layout("many_tiny_docs", (1, 2, 3, 1, 5, 2, 1, 4, 3, 2, 1, 1, 6)),
    Layout("long_next_to_short", (1, 61, 2, 40, 3)),
    Layout("single_doc", (37,)),
    Layout("trailing_padding", (5, 9, 3), num_pad_tokens=7),
    Layout("several_buckets", (50, 20, 18, 9, 3, 1, 33, 48)),
)
"""Attention: one-token softmaxes, a long document beside short ones, documents in several length buckets."""

FLEX_BLOCK_LAYOUTS = named(
    Layout("block_edges_and_padding", (1, 127, 1, 129, 2, 128, 259, 3), num_pad_tokens=5),
    Layout("one_short_doc", (5,)),
    Layout("long_then_short", (300, 20, 1)),
    Layout("whole_blocks", (64, 64, 64, 64)),
)
"""Flex attention's 128-token blocks: documents ending on, one short of and one past a block edge."""

CONV_LAYOUTS = named(
    Layout("one_token_docs", (1, 1, 1, 1, 1)),
    Layout("docs_shorter_than_width", (2, 3, 1, 2, 5, 1, 3)),
    Layout("long_next_to_short", (1, 40, 2, 25, 3)),
    Layout("single_doc", (19,)),
    Layout("trailing_padding", (5, 9, 3), num_pad_tokens=6),
)
"""Conv: documents shorter than the taps reach back (widths up to 8)."""

_C = GATED_DELTA_CHUNK
GATED_DELTA_LAYOUTS = named(
    Layout("one_token_docs", (1, 1, 1, 1, 1)),
    Layout("many_tiny_docs", (3, 1, 5, 2, 7, 1, 4, 2)),
    Layout("chunk_edges", (_C - 1, _C, _C + 1, 2 * _C, 2 * _C + 1)),
    Layout("edges_63_to_129", (63, 64, 65, 128, 129)),
    Layout("long_among_short", (5, 300, 2, 17, 1)),
    Layout("trailing_padding", (40, 70, 9), num_pad_tokens=13),
)
"""Gated delta rule (64-token chunks): documents ending on, one short of and one past chunk edges."""

SSD_LAYOUTS = named(
    Layout("one_token_docs", (1, 1, 1, 1, 1)),
    Layout("many_tiny_docs", (1, 2, 3, 1, 2, 5, 3, 1, 4, 2)),
    Layout("at_chunk_size", (16, 32, 16)),
    Layout("one_off_chunk_size", (15, 17, 33, 1, 31)),
    Layout("long_next_to_short", (3, 70, 1, 20)),
    Layout("trailing_padding", (5, 40, 9), num_pad_tokens=11),
)
"""Mamba-2 SSD at chunk size 16: boundaries at and one off the chunk edges."""

SSD_LONG_LAYOUT = Layout("long_among_short", (200, 7, 1, 64, 33), num_pad_tokens=15)
"""320 tokens: a document over several chunks of any size up to 64, then short ones and padding."""

KERNEL_LAYOUTS = named(
    Layout("one_token_docs_and_chunk_edges", (1, 63, 1, 65, 2), num_pad_tokens=7),
    Layout("long_next_to_short", (130, 1, 3)),
    Layout("chunk_aligned", (64, 64, 1)),
)
"""The real kernels (fla and mamba-ssm cut rows into 64-token chunks; conv taps reach W - 1 tokens back)."""

MODEL_LAYOUTS = named(
    Layout("adversarial", (1, 64, 1, 65, 63, 130, 2, 1)),
    Layout("long_next_to_short", (3, 200, 1)),
)
"""Whole models (op chunk size 64): one-token documents, documents under, at and over a chunk."""


# ---------------------------------------------------------------- closeness
def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, *, tol: float) -> None:
    """``|actual - expected| <= tol * (1 + |expected|)`` for every element: absolute near zero, relative
    beyond one. Shapes and dtypes must match (cast first to compare across precisions); a non-finite
    element fails. The message names ``what`` and its worst element."""
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)} != {list(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().double(), expected.detach().double()
    error = (a - e).abs()
    bad = ~(error <= tol * (1 + e.abs()))
    if bad.any():
        worst = torch.where(bad, error.nan_to_num(float("inf")), 0).argmax()
        index = tuple(i.item() for i in torch.unravel_index(worst, a.shape))
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} elements beyond {tol:g} * (1 + |expected|); "
                             f"worst at {list(index)}: {a[index].item():.6g} vs {e[index].item():.6g}")


# ---------------------------------------------------------------- op inputs
PUBLIC_OPS: dict[str, OpFn] = {"attention": varlen_attention, "conv": causal_conv1d, "gated_delta": gated_delta_rule,
                               "ssd": mamba2_ssd, "kda": kda, "decay_linear_attention": decay_linear_attention,
                               "selective_scan": selective_scan}


def public_op(op: str, backend: str = "torch") -> OpFn:
    """The public op with its backend forced, called as :meth:`CheckCase.call` calls it."""
    return functools.partial(PUBLIC_OPS[op], backend=backend)


def attention_signature(*, heads: int = 4, kv_heads: int = 4, dim: int = 8, causal: bool = True,
                        dtype: torch.dtype = torch.float64) -> Signature:
    return make_signature(H=heads, Hkv=kv_heads, D=dim, causal=causal, q=dtype, k=dtype, v=dtype)


def conv_signature(*, channels: int = 6, width: int = 4, activation: str | None = None, bias: bool = True,
                   dtype: torch.dtype = torch.float64, weight_dtype: torch.dtype | None = None) -> Signature:
    """``weight_dtype`` (default ``dtype``) is also the bias's."""
    weight_dtype = weight_dtype or dtype
    return make_signature(D=channels, W=width, activation=activation, x=dtype, weight=weight_dtype,
                          bias=weight_dtype if bias else None)


def gated_delta_signature(*, heads: int = 2, v_heads: int = 2, k_dim: int = 16, v_dim: int = 12,
                          use_qk_l2norm: bool = False, initial_state: bool = False, output_final_state: bool = True,
                          dtype: torch.dtype = torch.float64) -> Signature:
    return make_signature(H=heads, K=k_dim, HV=v_heads, V=v_dim, use_qk_l2norm=use_qk_l2norm,
                          output_final_state=output_final_state, q=dtype, k=dtype, v=dtype, g=dtype, beta=dtype,
                          initial_state=dtype if initial_state else None)


def ssd_signature(*, heads: int = 4, head_dim: int = 3, groups: int = 4, state_dim: int = 5, chunk_size: int = 16,
                  D: str | None = None, z: bool = False, dt_bias: bool = False, dt_softplus: bool = True,
                  initial_states: bool = False, return_final_states: bool = True,
                  dtype: torch.dtype = torch.float64) -> Signature:
    """``D``: ``None``, ``"H"`` (one skip weight per head) or ``"H,P"`` (one per channel)."""
    def given(flag: bool) -> torch.dtype | None:
        return dtype if flag else None

    return make_signature(H=heads, P=head_dim, G=groups, N=state_dim, chunk_size=chunk_size,
                          D_per_channel=None if D is None else D == "H,P", dt_softplus=dt_softplus,
                          return_final_states=return_final_states, x=dtype, dt=dtype, A=dtype, B=dtype, C=dtype,
                          D=given(D is not None), z=given(z), dt_bias=given(dt_bias),
                          initial_states=given(initial_states))


def op_inputs(op: str, signature: Signature, boundaries: PackedBoundaries, *, seed: int = 0,
              requires_grad: bool = True) -> CheckCase:
    """Inputs of ``op`` for ``signature`` from the op's own ``make_inputs``, drawn from ``seed``; every
    floating tensor is a leaf that requires grad (unless ``requires_grad=False``)."""
    case = contract_of(op).make_case(signature, boundaries, torch.Generator().manual_seed(seed))
    arguments = {name: value.requires_grad_(requires_grad) if _is_float(value) else value
                 for name, value in case.arguments.items()}
    return dataclasses.replace(case, arguments=arguments)


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


# ---------------------------------------------------------------- segments
def segment_spans(boundaries: PackedBoundaries) -> list[slice]:
    """Every segment's tokens in the row, the padding segment last."""
    return [slice(start, start + length) for start, length in zip(boundaries.starts, boundaries.segment_lengths)]


def segment_arguments(case: CheckCase, boundaries: PackedBoundaries, segment: int,
                      arguments: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The inputs of one segment run alone: its slice of every per-token input, its document's initial
    state (none for the padding segment), everything else shared."""
    args = case.arguments if arguments is None else arguments
    span = segment_spans(boundaries)[segment]
    alone = dict(args)
    for name in case.token_inputs:
        if args.get(name) is not None:
            alone[name] = args[name][:, span]
    for name in case.document_inputs:
        if args.get(name) is not None:
            alone[name] = args[name][segment:segment + 1] if segment < boundaries.num_docs else None
    return alone


# ---------------------------------------------------------------- running an op
def run(op: str, fn: OpFn, case: CheckCase, boundaries: PackedBoundaries,
        arguments: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """``fn`` on the case's inputs (or ``arguments``); what it returned, by name: ``output`` per token and
    ``final_state`` per document (when returned)."""
    tokens, documents = contract_of(op).outputs(case.call(fn, boundaries, arguments))
    assert len(tokens) == 1 and len(documents) <= 1, f"{op}: unexpected outputs"
    return {"output": tokens[0]} | ({"final_state": documents[0]} if documents else {})


def projection(outputs: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Random float64 weights, one per output, drawn from ``seed``: ``sum(output * weight)`` is the loss."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(out.shape, generator=generator, dtype=torch.float64) for name, out in outputs.items()}


def _loss(outputs: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return sum((out.double() * weights[name]).sum() for name, out in outputs.items())


def gradients(loss: torch.Tensor, arguments: Mapping[str, Any], *, retain_graph: bool = False
              ) -> dict[str, torch.Tensor]:
    """``d<name>`` for every tensor argument that requires grad."""
    leaves = {name: value for name, value in arguments.items()
              if isinstance(value, torch.Tensor) and value.requires_grad}
    grads = torch.autograd.grad(loss, list(leaves.values()), retain_graph=retain_graph)
    return {f"d{name}": grad for name, grad in zip(leaves, grads)}


def forward_backward(op: str, fn: OpFn, case: CheckCase, boundaries: PackedBoundaries, *, seed: int = 1,
                     arguments: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """:func:`run`'s outputs and, when any input requires grad, the gradients of their :func:`projection`."""
    args = case.arguments if arguments is None else arguments
    outputs = run(op, fn, case, boundaries, args)
    if not any(isinstance(v, torch.Tensor) and v.requires_grad for v in args.values()):
        return outputs
    return outputs | gradients(_loss(outputs, projection(outputs, seed)), args)


# ---------------------------------------------------------------- the two proofs
def assert_packed_equals_segments_alone(op: str, fn: OpFn, case: CheckCase, boundaries: PackedBoundaries, *,
                                        tol: float, seed: int = 1) -> dict[str, torch.Tensor]:
    """Every segment run alone (one-document boundaries, its slice of the inputs, its document's initial
    state) gives what it got in the packed row, and the gradients of one random projection agree: the
    packed loss against the sum of the segments' losses, on every input (shared weights summed over
    segments). Returns the packed outputs."""
    packed = run(op, fn, case, boundaries)
    weights = projection(packed, seed)
    alone_loss = torch.zeros((), dtype=torch.float64)
    for segment, span in enumerate(segment_spans(boundaries)):
        alone_boundaries = PackedBoundaries.from_lengths([span.stop - span.start])
        alone = run(op, fn, case, alone_boundaries, segment_arguments(case, boundaries, segment))
        what = f"segment {segment} ({span.stop - span.start} tokens)"
        assert_close(alone["output"], packed["output"][:, span], f"{what}: output", tol=tol)
        alone_loss = alone_loss + (alone["output"].double() * weights["output"][:, span]).sum()
        if "final_state" in packed and segment < boundaries.num_docs:
            rows = slice(segment, segment + 1)
            assert_close(alone["final_state"], packed["final_state"][rows], f"{what}: final_state", tol=tol)
            alone_loss = alone_loss + (alone["final_state"].double() * weights["final_state"][rows]).sum()
    packed_grads = gradients(_loss(packed, weights), case.arguments)
    alone_grads = gradients(alone_loss, case.arguments)
    for name, grad in packed_grads.items():
        assert_close(grad, alone_grads[name], f"{name} (packed against segments alone)", tol=tol)
    return packed


def assert_no_gradient_crosses_segments(op: str, fn: OpFn, case: CheckCase, boundaries: PackedBoundaries, *,
                                        seed: int = 2,
                                        may_vanish: Callable[[str, int], bool] = lambda name, length: False
                                        ) -> None:
    """For every segment, the gradient of a random projection of its outputs (and of its document's final
    state) is exactly zero on every other segment's per-token inputs and every other document's initial
    state, and nonzero on its own per-token inputs and initial state (``may_vanish(name, length)`` names
    inputs whose gradient is zero by definition, such as a one-token softmax's q and k)."""
    packed = run(op, fn, case, boundaries)
    weights = projection(packed, seed)
    for segment, span in enumerate(segment_spans(boundaries)):
        inside = torch.zeros(boundaries.total_tokens, dtype=torch.bool)
        inside[span] = True
        loss = (packed["output"][:, span].double() * weights["output"][:, span]).sum()
        if "final_state" in packed and segment < boundaries.num_docs:
            loss = loss + (packed["final_state"][segment].double() * weights["final_state"][segment]).sum()
        grads = gradients(loss, case.arguments, retain_graph=True)
        length = span.stop - span.start
        for name in case.token_inputs:
            if f"d{name}" not in grads:
                continue
            grad = grads[f"d{name}"][0]
            assert torch.count_nonzero(grad[~inside]) == 0, f"d{name}: segment {segment} reaches other segments"
            if not may_vanish(name, length):
                assert torch.count_nonzero(grad[inside]) > 0, f"d{name}: zero inside segment {segment}"
        for name in case.document_inputs:
            if f"d{name}" not in grads:
                continue
            grad = grads[f"d{name}"]
            own = torch.arange(grad.shape[0]) == segment
            assert torch.count_nonzero(grad[~own]) == 0, f"d{name}: segment {segment} reaches other documents"
            assert segment >= boundaries.num_docs or torch.count_nonzero(grad[own]) > 0, (
                f"d{name}: zero on document {segment}'s own initial state")


# ---------------------------------------------------------------- planted defects
class _GradientLeak(torch.autograd.Function):
    """Identity forward; backward hands each token a little of the next token's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad + 1e-3 * grad.roll(-1, dims=1)


class _BackwardRaises(torch.autograd.Function):
    """Identity forward; backward raises."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("planted backward failure")


def _on_token_outputs(result: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to the per-token outputs ``[1, T, ...]`` of an op's result (final states untouched)."""
    if isinstance(result, tuple):
        return tuple(fn(r) if isinstance(r, torch.Tensor) and r.dim() > 1 and r.shape[0] == 1 else r
                     for r in result)
    return fn(result)


DEFECTS = ("ignores_boundaries", "gradient_leak", "one_percent_off", "tenth_percent_off", "raises", "backward_raises",
           "ignores_boundaries_without_grad", "float64_outputs")
"""What :func:`with_defect` can plant: a forward leak, a leak only through the gradient, a 1% error, an
exception, an exception in the backward pass, a leak only in calls without gradients (an inference path of its
own), per-token outputs in float64 whatever the inputs' dtype."""


def with_defect(fn: OpFn, defect: str) -> OpFn:
    """``fn`` (an op, called like :meth:`CheckCase.call` calls it) with one of :data:`DEFECTS`."""
    if defect not in DEFECTS:
        raise ValueError(f"defect: expected one of {DEFECTS}; got {defect!r}")

    def planted(*args: Any, **kwargs: Any) -> Any:
        *tensors, boundaries = args
        if defect == "raises":
            raise RuntimeError("planted failure")
        if defect == "ignores_boundaries" or (defect == "ignores_boundaries_without_grad"
                                              and not torch.is_grad_enabled()):
            boundaries = PackedBoundaries.from_lengths([boundaries.total_tokens])
            kwargs = {k: v[:1] if k in ("initial_state", "initial_states") and v is not None else v
                      for k, v in kwargs.items()}
        result = fn(*tensors, boundaries, **kwargs)
        if defect == "one_percent_off":
            return _on_token_outputs(result, lambda t: t * 1.01)
        if defect == "tenth_percent_off":
            return _on_token_outputs(result, lambda t: t * 1.001)
        if defect == "gradient_leak":
            return _on_token_outputs(result, _GradientLeak.apply)
        if defect == "backward_raises":
            return _on_token_outputs(result, _BackwardRaises.apply)
        if defect == "float64_outputs":
            return _on_token_outputs(result, torch.Tensor.double)
        return result

    return planted


def widened(module: torch.nn.Module, std: float = 0.2, seed: int = 1) -> torch.nn.Module:
    """``module`` with every weight matrix redrawn at ``std`` (a leak then moves the logits by their own size)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, std)
    return module
