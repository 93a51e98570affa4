"""The pure-torch Mamba-2 SSD backend: packed rows behave exactly like documents run alone.

Every check goes through the public op ``hybrid_pack.ops.mamba2_ssd(..., backend="torch")`` and is
compared with (a) each document run on its own and (b) the per-token recurrence in
``tests.ops.reference.ssd``, forward and backward, on layouts chosen to break chunking: one-token
documents, boundaries at and one off the chunk size, long documents next to short ones, a trailing
padding segment.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_pack import PackedBoundaries
from tests import kit
from tests.kit import SSD_LAYOUTS as LAYOUTS
from tests.kit import SSD_LONG_LAYOUT
from tests.ops.reference.ssd import mamba2_ssd_reference

OP = "ssd"
TORCH = kit.public_op(OP)
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
FLAGS = {  # groups, skip weights D (per head or per channel), gate z, dt_bias, softplus, initial states
    "plain": {"groups": 4, "D": None, "z": False, "dt_bias": False, "dt_softplus": True, "initial_states": False},
    "full": {"groups": 2, "D": "H,P", "z": True, "dt_bias": True, "dt_softplus": True, "initial_states": True},
    "one_group_d_per_head": {"groups": 1, "D": "H", "z": True, "dt_bias": False, "dt_softplus": True,
                             "initial_states": True},
    "no_softplus": {"groups": 2, "D": "H", "z": False, "dt_bias": True, "dt_softplus": False,
                    "initial_states": False},
}
PER_TOKEN = ("x", "dt", "B", "C", "z")
EVERY_INPUT = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")  # with FLAGS["full"]


def inputs(layout: kit.Layout | PackedBoundaries, flags: str, *, dtype: torch.dtype = torch.float64,
           seed: int = 0, requires_grad: bool = True, **changes) -> tuple[kit.CheckCase, PackedBoundaries]:
    """Inputs of the op at chunk size 16 (unless ``changes`` say otherwise) with ``FLAGS[flags]``."""
    boundaries = layout.boundaries() if isinstance(layout, kit.Layout) else layout
    signature = kit.ssd_signature(**FLAGS[flags] | changes, dtype=dtype)
    return kit.op_inputs(OP, signature, boundaries, seed=seed, requires_grad=requires_grad), boundaries


@pytest.mark.parametrize("flags", list(FLAGS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_equals_documents_alone(layout: str, flags: str) -> None:
    case, boundaries = inputs(LAYOUTS[layout], flags)
    packed = kit.assert_packed_equals_segments_alone(OP, TORCH, case, boundaries, tol=TOLERANCE[torch.float64])
    assert packed["output"].dtype == packed["final_state"].dtype == torch.float64


@pytest.mark.parametrize("layout", ["one_off_chunk_size", "trailing_padding"])
def test_packed_equals_documents_alone_float32(layout: str) -> None:
    case, boundaries = inputs(LAYOUTS[layout], "full", dtype=torch.float32)
    packed = kit.assert_packed_equals_segments_alone(OP, TORCH, case, boundaries, tol=TOLERANCE[torch.float32])
    assert packed["output"].dtype == packed["final_state"].dtype == torch.float32


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64])
@pytest.mark.parametrize("flags", ["full", "no_softplus"])
def test_matches_per_token_reference(chunk_size: int, flags: str) -> None:
    """Forward and final states equal the recurrence for every chunk size (so chunking is invisible)."""
    case, boundaries = inputs(SSD_LONG_LAYOUT, flags, chunk_size=chunk_size, requires_grad=False)
    got = kit.run(OP, TORCH, case, boundaries)
    want = kit.run(OP, mamba2_ssd_reference, case, boundaries)
    for name in ("output", "final_state"):
        kit.assert_close(got[name], want[name], name, tol=TOLERANCE[torch.float64])


def test_gradients_match_per_token_reference() -> None:
    case, boundaries = inputs(SSD_LONG_LAYOUT, "full")
    got = kit.forward_backward(OP, TORCH, case, boundaries)
    want = kit.forward_backward(OP, mamba2_ssd_reference, case, boundaries)
    assert set(got) == set(want) == {"output", "final_state", *(f"d{name}" for name in EVERY_INPUT)}
    for name in got:
        kit.assert_close(got[name], want[name], name, tol=TOLERANCE[torch.float64])


@pytest.mark.parametrize("layout", ["many_tiny_docs", "one_off_chunk_size", "long_next_to_short", "trailing_padding"])
def test_no_gradient_crosses_documents(layout: str) -> None:
    """The loss of one segment has exactly zero gradient on every other segment's tokens and state."""
    case, boundaries = inputs(LAYOUTS[layout], "full")
    kit.assert_no_gradient_crosses_segments(OP, TORCH, case, boundaries)


def test_other_documents_do_not_change_the_output() -> None:
    """Rewriting every token outside one document (token 0 included) leaves that document bit-identical."""
    case, boundaries = inputs(LAYOUTS["one_off_chunk_size"], "full", requires_grad=False)
    other, _ = inputs(LAYOUTS["one_off_chunk_size"], "full", seed=7, requires_grad=False)
    doc, rows = 2, kit.segment_spans(boundaries)[2]
    changed = dict(case.arguments)
    for name in PER_TOKEN:
        changed[name] = other.arguments[name].clone()
        changed[name][:, rows] = case.arguments[name][:, rows]
    y, final = case.call(TORCH, boundaries)
    y2, final2 = case.call(TORCH, boundaries, changed)
    assert not torch.equal(y, y2)  # the other documents did change
    assert torch.equal(y[:, rows], y2[:, rows])
    assert torch.equal(final[doc], final2[doc])


def test_masked_chunk_tail_changes_nothing() -> None:
    """A document ending mid-chunk keeps the state it had at its last token: appending tokens whose dt
    makes no step (dt = 0 without softplus) yields the same final state."""
    case, short = inputs(PackedBoundaries.from_lengths([21]), "no_softplus", dt_bias=False, requires_grad=False)
    longer, long_ = inputs(PackedBoundaries.from_lengths([32]), "no_softplus", dt_bias=False, requires_grad=False)
    extended = dict(case.arguments)
    for name in ("x", "dt", "B", "C"):
        extended[name] = longer.arguments[name].clone()
        extended[name][:, :21] = case.arguments[name]
    extended["dt"][:, 21:] = 0.0
    _, final = case.call(TORCH, short)
    _, final_longer = case.call(TORCH, long_, extended)
    kit.assert_close(final, final_longer, "final state", tol=TOLERANCE[torch.float64])


def test_dt_is_clamped_at_zero_without_softplus() -> None:
    """Like mamba-ssm's default ``dt_limit=(0, inf)``: a negative dt is a zero step."""
    case, boundaries = inputs(LAYOUTS["one_off_chunk_size"], "no_softplus", requires_grad=False)
    y, _ = case.call(TORCH, boundaries)
    negative = {**case.arguments, "dt": case.arguments["dt"] - 10.0, "dt_bias": None}
    y_neg, final_neg = case.call(TORCH, boundaries, negative)
    x, D = case.arguments["x"], case.arguments["D"]
    kit.assert_close(y_neg, x * D[:, None], "output", tol=1e-7)
    assert torch.equal(final_neg, torch.zeros_like(final_neg))
    assert not torch.allclose(y, y_neg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_in_float32(dtype: torch.dtype) -> None:
    """Half inputs are computed in float32: only the output rounding differs from a float32 run."""
    half, boundaries = inputs(LAYOUTS["long_next_to_short"], "full", dtype=dtype)
    full = {name: x.detach().float().requires_grad_() if isinstance(x, torch.Tensor) else x
            for name, x in half.arguments.items()}
    y_half, final_half = half.call(TORCH, boundaries)
    y_full, final_full = half.call(TORCH, boundaries, full)
    assert y_half.dtype == dtype and final_half.dtype == torch.float32
    kit.assert_close(y_half.float(), y_full, "output", tol=1e-2)
    kit.assert_close(final_half, final_full, "final state", tol=1e-5)

    g_half = kit.gradients(y_half.float().sum(), half.arguments)
    g_full = kit.gradients(y_full.sum(), full)
    for name, grad in g_half.items():
        assert grad.dtype == dtype
        assert torch.isfinite(grad).all()
        scale = g_full[name].abs().max()
        kit.assert_close(grad.float() / scale, g_full[name] / scale, name, tol=1.5e-2)


def test_returns_only_y_without_final_states() -> None:
    case, boundaries = inputs(LAYOUTS["trailing_padding"], "plain", return_final_states=False, requires_grad=False)
    y = case.call(TORCH, boundaries)
    assert isinstance(y, torch.Tensor) and y.shape == case.arguments["x"].shape
