"""causal_conv1d (torch backend): taps never cross a document start, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_pack.boundaries import PackedBoundaries
from tests import kit
from tests.kit import CONV_LAYOUTS as LAYOUTS
from tests.ops.reference.conv import causal_conv1d_ref

OP = "conv"
TORCH = kit.public_op(OP)
WIDTHS = range(1, 9)
FLOAT64_TOL = 5e-14


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_per_token_reference_float64(layout: str, width: int, activation: str | None) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    case = kit.op_inputs(OP, kit.conv_signature(width=width, activation=activation), boundaries)
    got = kit.forward_backward(OP, TORCH, case, boundaries)
    want = kit.forward_backward(OP, causal_conv1d_ref, case, boundaries)
    for name in ("output", "dx", "dweight", "dbias"):
        kit.assert_close(got[name], want[name], name, tol=FLOAT64_TOL)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_each_document_alone(layout: str, width: int, with_bias: bool) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    signature = kit.conv_signature(width=width, activation="silu", bias=with_bias)
    case = kit.op_inputs(OP, signature, boundaries, seed=1)
    kit.assert_packed_equals_segments_alone(OP, TORCH, case, boundaries, tol=FLOAT64_TOL)


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("layout", ["docs_shorter_than_width", "long_next_to_short", "trailing_padding"])
def test_no_gradient_crosses_a_boundary(layout: str, width: int) -> None:
    boundaries = LAYOUTS[layout].boundaries()
    case = kit.op_inputs(OP, kit.conv_signature(width=width, activation="silu"), boundaries, seed=2)
    kit.assert_no_gradient_crosses_segments(OP, TORCH, case, boundaries)


def test_non_finite_values_stay_in_their_document() -> None:
    boundaries = LAYOUTS["long_next_to_short"].boundaries()
    case = kit.op_inputs(OP, kit.conv_signature(dtype=torch.float32), boundaries, seed=3, requires_grad=False)
    poisoned = kit.segment_spans(boundaries)[1]
    case.arguments["x"][:, poisoned] = float("inf")
    out = case.call(TORCH, boundaries)
    assert not out[:, poisoned].isfinite().any()
    out[:, poisoned] = 0
    assert out.isfinite().all()


@pytest.mark.parametrize("width", [1, 3, 4])
def test_weight_convention_matches_causal_conv1d(width: int) -> None:
    """On one document, equals causal-conv1d's reference: depthwise F.conv1d, W - 1 zeros in front."""
    boundaries = PackedBoundaries.from_lengths([23])
    case = kit.op_inputs(OP, kit.conv_signature(width=width, activation="silu"), boundaries, seed=4,
                         requires_grad=False)
    x, weight, bias = (case.arguments[name] for name in ("x", "weight", "bias"))
    out = case.call(TORCH, boundaries)
    expected = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[2])[..., :23]
    kit.assert_close(out, F.silu(expected).transpose(1, 2), "output", tol=FLOAT64_TOL)


def test_last_tap_is_the_current_token_and_first_tap_the_oldest() -> None:
    boundaries = PackedBoundaries.from_lengths([4, 3])
    x = torch.arange(1.0, 8.0).view(1, 7, 1)
    current = TORCH(x, torch.tensor([[0.0, 0.0, 1.0]]), None, boundaries)
    oldest = TORCH(x, torch.tensor([[1.0, 0.0, 0.0]]), None, boundaries)
    assert current.flatten().tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert oldest.flatten().tolist() == [0, 0, 1, 2, 0, 0, 5]


def test_swish_is_silu() -> None:
    boundaries = LAYOUTS["long_next_to_short"].boundaries()
    case = kit.op_inputs(OP, kit.conv_signature(activation="silu", dtype=torch.float32), boundaries,
                         requires_grad=False)
    conv = kit.PUBLIC_OPS[OP]  # the automatic choice of backend
    swish = case.call(conv, boundaries, {**case.arguments, "activation": "swish"})
    assert torch.equal(case.call(conv, boundaries), swish)


def test_float32_matches_reference() -> None:
    boundaries = LAYOUTS["long_next_to_short"].boundaries()
    signature = kit.conv_signature(channels=32, activation="silu", dtype=torch.float32)
    case = kit.op_inputs(OP, signature, boundaries, seed=5)
    got = kit.forward_backward(OP, TORCH, case, boundaries)
    want = kit.forward_backward(OP, causal_conv1d_ref, case, boundaries)
    assert got["output"].dtype == torch.float32
    for name in ("output", "dx", "dweight", "dbias"):
        kit.assert_close(got[name], want[name], name, tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_dtype_and_tracks_float64(dtype: torch.dtype) -> None:
    boundaries = LAYOUTS["docs_shorter_than_width"].boundaries()
    case = kit.op_inputs(OP, kit.conv_signature(activation="silu", dtype=dtype), boundaries, seed=6)
    out = case.call(TORCH, boundaries)
    out.float().sum().backward()
    ref = causal_conv1d_ref(*(case.arguments[name].double() for name in ("x", "weight", "bias")), boundaries,
                            activation="silu")
    x, weight = case.arguments["x"], case.arguments["weight"]
    assert out.dtype == dtype and x.grad.dtype == dtype and weight.grad.dtype == dtype
    kit.assert_close(out.double(), ref, "output", tol=1e-2)


def test_float32_weight_on_bfloat16_input() -> None:
    boundaries = LAYOUTS["trailing_padding"].boundaries()
    signature = kit.conv_signature(dtype=torch.bfloat16, weight_dtype=torch.float32)
    case = kit.op_inputs(OP, signature, boundaries, seed=7, requires_grad=False)
    out = case.call(TORCH, boundaries)
    ref = causal_conv1d_ref(*(case.arguments[name].double() for name in ("x", "weight", "bias")), boundaries)
    assert out.dtype == torch.bfloat16
    kit.assert_close(out.double(), ref, "output", tol=1e-2)
