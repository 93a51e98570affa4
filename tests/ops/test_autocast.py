"""A caller's ``torch.autocast`` does not reach inside the recurrences' pure-torch backends: float32 inputs give the
same outputs, states and gradients with and without it (docs/ops.md: the recurrences compute in float32)."""

from __future__ import annotations

import pytest
import torch

from hybrid_pack.boundaries import PackedBoundaries, StaticBoundaries
from hybrid_pack.ops.dispatch.registry import contract_of, get_backend
from hybrid_pack.ops.dispatch.route import route_of

RECURRENCES = ("gated_delta", "kda", "decay_linear_attention", "ssd", "selective_scan")
BOUNDARIES = PackedBoundaries.from_document_lengths([3, 20, 1, 17], num_pad_tokens=3)


def _run(op: str, fn: object, boundaries: object, autocast: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs and token-input gradients of ``fn`` on the op's float32 case, under bfloat16 autocast or not."""
    contract = contract_of(op)
    case = contract.make_case(contract.default_signature(torch.float32, "cpu"), BOUNDARIES,
                              torch.Generator().manual_seed(0))
    leaves = {name: case.arguments[name].detach().clone().requires_grad_(True) for name in case.token_inputs
              if case.arguments[name] is not None}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        result = case.call(fn, boundaries, {**case.arguments, **leaves})
    outputs = [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]
    sum(o.double().sum() * (i + 1) for i, o in enumerate(outputs)).backward()
    return outputs, [leaf.grad for leaf in leaves.values()]


@pytest.mark.parametrize(("op", "form"), [(op, "public") for op in RECURRENCES]
                         + [(op, "static") for op in RECURRENCES if get_backend(op, "torch").static_fn is not None])
def test_float32_inputs_compute_in_float32_under_autocast(op: str, form: str) -> None:
    if form == "public":
        fn, boundaries = route_of(op).public, BOUNDARIES
    else:
        fn, boundaries = get_backend(op, "torch").static_fn, StaticBoundaries.from_boundaries(BOUNDARIES, 6)
    plain, plain_grads = _run(op, fn, boundaries, autocast=False)
    cast, cast_grads = _run(op, fn, boundaries, autocast=True)
    assert [o.dtype for o in cast] == [o.dtype for o in plain]
    for expected, got in zip(plain + plain_grads, cast + cast_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
