"""The kit's checks can fail, each for the reason it names: planted defects that an op test relies on the
kit to catch are caught."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import kit

LAYOUT = kit.Layout("with_padding", (3, 1, 6), num_pad_tokens=2)


def ignores_boundaries(op: str) -> kit.OpFn:
    """The torch backend run as if the row were one document (each document's initial state dropped)."""
    return kit.with_defect(kit.public_op(op), "ignores_boundaries")


def leaks_gradients(op: str) -> kit.OpFn:
    """The torch backend with a correct forward and a backward that crosses every boundary."""
    return kit.with_defect(kit.public_op(op), "gradient_leak")


def drops_the_last_segment(op: str) -> kit.OpFn:
    """The torch backend with the last segment's outputs zeroed: nothing flows back into it."""
    def fn(*args: Any, **kwargs: Any) -> Any:
        result = kit.public_op(op)(*args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        kept = torch.ones(out.shape[1], dtype=out.dtype)
        kept[-LAYOUT.num_pad_tokens:] = 0
        out = out * kept.view(1, -1, *([1] * (out.dim() - 2)))
        return (out, *result[1:]) if isinstance(result, tuple) else out
    return fn


SIGNATURES = {"conv": kit.conv_signature(width=3), "ssd": kit.ssd_signature(initial_states=True, chunk_size=4)}


@pytest.mark.parametrize("op", SIGNATURES)
def test_the_torch_backends_pass(op: str) -> None:
    boundaries = LAYOUT.boundaries()
    case = kit.op_inputs(op, SIGNATURES[op], boundaries)
    kit.assert_packed_equals_segments_alone(op, kit.public_op(op), case, boundaries, tol=1e-12)
    kit.assert_no_gradient_crosses_segments(op, kit.public_op(op), case, boundaries)


@pytest.mark.parametrize("op", SIGNATURES)
@pytest.mark.parametrize(("defect", "message"), [(ignores_boundaries, r"^segment \d \(\d+ tokens\): "),
                                                 (leaks_gradients, r"packed against segments alone")])
def test_packed_against_alone_catches(op: str, defect: Any, message: str) -> None:
    boundaries = LAYOUT.boundaries()
    case = kit.op_inputs(op, SIGNATURES[op], boundaries)
    with pytest.raises(AssertionError, match=message):
        kit.assert_packed_equals_segments_alone(op, defect(op), case, boundaries, tol=1e-12)


@pytest.mark.parametrize("op", SIGNATURES)
@pytest.mark.parametrize(("defect", "message"), [(ignores_boundaries, "reaches other"),
                                                 (leaks_gradients, "reaches other segments"),
                                                 (drops_the_last_segment, "zero inside segment 3")])
def test_no_gradient_crossing_catches(op: str, defect: Any, message: str) -> None:
    boundaries = LAYOUT.boundaries()
    case = kit.op_inputs(op, SIGNATURES[op], boundaries)
    with pytest.raises(AssertionError, match=message):
        kit.assert_no_gradient_crosses_segments(op, defect(op), case, boundaries)


def test_assert_close_is_absolute_near_zero_and_relative_beyond_one() -> None:
    expected = torch.tensor([0.0, 1000.0], dtype=torch.float64)
    kit.assert_close(expected + torch.tensor([0.9e-6, 0.9e-3], dtype=torch.float64), expected, "x", tol=1e-6)
    with pytest.raises(AssertionError, match=r"^x: 1 of 2 elements beyond 1e-06 .* worst at \[0\]"):
        kit.assert_close(expected + torch.tensor([2e-6, 0.0], dtype=torch.float64), expected, "x", tol=1e-6)
    with pytest.raises(AssertionError, match=r"worst at \[1\]"):
        kit.assert_close(expected + torch.tensor([0.0, 2e-3], dtype=torch.float64), expected, "x", tol=1e-6)


@pytest.mark.parametrize(("actual", "message"), [
    (torch.tensor([float("nan"), 1.0]), r"^y: 1 of 2 elements"),
    (torch.tensor([float("inf"), 1.0]), r"^y: 1 of 2 elements"),
    (torch.tensor([1.0, 1.0, 1.0]), r"^y: shape \[3\] != \[2\]"),
    (torch.tensor([1.0, 1.0], dtype=torch.float64), r"^y: dtype torch.float64 != torch.float32"),
])
def test_assert_close_refuses_non_finite_values_and_mismatched_tensors(actual: torch.Tensor, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        kit.assert_close(actual, torch.tensor([1.0, 1.0]), "y", tol=1.0)


def test_layouts_build_their_documents_then_the_padding() -> None:
    boundaries = LAYOUT.boundaries()
    assert boundaries.document_lengths == [3, 1, 6] and boundaries.num_pad_tokens == 2
    assert boundaries.segment_lengths == (3, 1, 6, 2) and boundaries.total_tokens == LAYOUT.total_tokens
    assert [s.stop - s.start for s in kit.segment_spans(boundaries)] == [3, 1, 6, 2]


def test_segment_arguments_slice_tokens_and_pick_the_documents_state() -> None:
    boundaries = LAYOUT.boundaries()
    case = kit.op_inputs("ssd", SIGNATURES["ssd"], boundaries, requires_grad=False)
    second = kit.segment_arguments(case, boundaries, 1)
    assert torch.equal(second["x"], case.arguments["x"][:, 3:4])
    assert torch.equal(second["initial_states"], case.arguments["initial_states"][1:2])
    assert second["A"] is case.arguments["A"]
    assert kit.segment_arguments(case, boundaries, 3)["initial_states"] is None  # the padding segment has none
