"""The one engine under every "packed equals alone" check (hybrid_pack.isolation): it passes equal outputs
and catches a difference above the tolerance, a non-finite value and a gradient leaking out of its segment.

The op under test is a running sum over a packed row that restarts at each document (isolated) or does not
(leaky): the leak is real, forward and backward, not a planted number."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError
from hybrid_pack.isolation import (
    TOLERANCE,
    Layout,
    Mismatch,
    adversarial_cp_row,
    assert_gradient_inside,
    compare,
    leaked_gradient,
    least_precise,
    relative_error,
    selfcheck_layout,
    tolerance_for,
)

LAYOUT = Layout("three documents and padding", (3, 1, 5), num_pad_tokens=2)


def running_sum(x: torch.Tensor, boundaries: PackedBoundaries, *, restart: bool = True) -> torch.Tensor:
    """``[T, D] -> [T, D]``: the sum of the tokens so far, of the token's own segment when ``restart``."""
    if not restart:
        return x.cumsum(0)
    return torch.cat([x[s:s + n].cumsum(0) for s, n in zip(boundaries.starts, boundaries.segment_lengths)])


def packed_and_alone(restart: bool, dtype: torch.dtype = torch.float64) -> tuple[list[torch.Tensor], ...]:
    """Each segment's outputs in the packed row, and each segment run alone."""
    boundaries = LAYOUT.boundaries()
    x = torch.randn(LAYOUT.total_tokens, 4, generator=torch.Generator().manual_seed(0), dtype=dtype)
    packed = running_sum(x, boundaries, restart=restart)
    spans = [slice(s, s + n) for s, n in zip(boundaries.starts, boundaries.segment_lengths)]
    alone = [running_sum(x[span], PackedBoundaries.from_lengths([span.stop - span.start])) for span in spans]
    return [packed[span] for span in spans], alone


def test_equal_outputs_pass_and_rounding_stays_within_the_dtype_tolerance() -> None:
    packed, alone = packed_and_alone(restart=True)
    assert compare("packed against alone", packed, alone, TOLERANCE[torch.float64]) == 0.0
    rounded = [t.float() for t in packed]        # float32 rounding of the same values
    error = compare("float32 against float64", rounded, alone, TOLERANCE[torch.float32])
    assert 0.0 < error < 1e-6


def test_a_leak_forward_is_a_difference_above_the_tolerance_named_with_its_size() -> None:
    packed, alone = packed_and_alone(restart=False)
    with pytest.raises(Mismatch) as info:
        compare("packed against alone", packed, alone, TOLERANCE[torch.float32],
                names=[f"segment {i}" for i in range(len(packed))])
    failure = info.value
    assert failure.what == "packed against alone: segment 1"    # segment 0 starts the row: it cannot differ
    assert failure.error > 1e-2 and failure.tolerance == TOLERANCE[torch.float32]
    assert f"differs by {failure.error:.3g} (tolerance 5e-03)" in str(failure)


def test_one_percent_off_is_caught_in_float32_at_any_scale() -> None:
    expected = torch.randn(6, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for scale in (1e-6, 1.0, 1e6):
        assert relative_error(1.01 * scale * expected, scale * expected) == pytest.approx(0.01)
        with pytest.raises(Mismatch, match="differs by 0.01"):
            compare("scaled", [1.01 * scale * expected], [scale * expected], TOLERANCE[torch.float32])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("side", ["actual", "expected"])
def test_a_non_finite_value_is_an_infinite_error(bad: float, side: str) -> None:
    good = torch.ones(4, dtype=torch.float32)
    broken = good.clone()
    broken[2] = bad
    actual, expected = (broken, good) if side == "actual" else (good, broken)
    assert relative_error(actual, expected) == float("inf")
    with pytest.raises(Mismatch) as info:
        compare("outputs", [actual], [expected], TOLERANCE[torch.bfloat16])
    assert info.value.error == float("inf") and "output 0 differs by inf" in str(info.value)


def test_a_count_or_shape_that_differs_fails() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(Mismatch, match="returned 1 outputs, expected 2"):
        compare("outputs", [x], [x, x], 1.0)
    with pytest.raises(Mismatch, match=r"output 0 has shape \[3, 2\], expected \[2, 3\]"):
        compare("outputs", [x.t()], [x], 1.0)
    assert relative_error(x.t(), x) == float("inf")


@pytest.mark.parametrize("restart", [True, False], ids=["isolated", "leaky"])
def test_a_gradient_leaking_out_of_its_segment_is_caught_and_none_is_passed(restart: bool) -> None:
    boundaries = LAYOUT.boundaries()
    x = torch.randn(LAYOUT.total_tokens, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64,
                    requires_grad=True)
    out = running_sum(x, boundaries, restart=restart)
    for segment, (start, length) in enumerate(zip(boundaries.starts, boundaries.segment_lengths)):
        span = slice(start, start + length)
        (grad,) = torch.autograd.grad(out[span].sum(), x, retain_graph=True)
        own = leaked_gradient(grad, span) == 0.0
        assert grad[span].abs().min() > 0                # its own tokens do get gradient
        if restart or segment == 0:                      # a running sum reaches back: the first segment is clean
            assert own
            assert_gradient_inside(f"segment {segment}", grad, span)
        else:
            assert not own                               # each earlier token feeds all `length` outputs
            with pytest.raises(Mismatch, match=rf"segment {segment} \(max {length}; must be exactly 0\)") as info:
                assert_gradient_inside(f"segment {segment}", grad, span)
            assert info.value.error == length and info.value.tolerance == 0.0


def test_any_nonzero_gradient_outside_counts_along_any_axis() -> None:
    grad = torch.zeros(1, 6, 2)                          # per token, [1, T, D]
    assert leaked_gradient(grad, slice(2, 4), dim=1) == 0.0
    grad[0, 5, 1] = 1e-30                                # far below any tolerance: still a leak
    assert leaked_gradient(grad, slice(2, 4), dim=1) == pytest.approx(1e-30)
    assert leaked_gradient(grad, slice(4, 6), dim=1) == 0.0
    grad[0, 0, 0] = float("nan")
    assert leaked_gradient(grad, slice(2, 4), dim=1) == float("inf")
    states = torch.zeros(3, 5)                           # one row per document; the padding segment owns none
    states[1] = 1.0
    assert leaked_gradient(states, slice(1, 2)) == 0.0 and leaked_gradient(states, slice(3, 4)) == 1.0


def test_the_tolerance_is_that_of_the_least_precise_floating_dtype() -> None:
    assert least_precise([torch.float32, torch.bfloat16, torch.int64]) == torch.bfloat16
    assert least_precise([torch.int32]) == torch.float32
    assert tolerance_for([torch.float64, torch.float16]) == TOLERANCE[torch.float16]
    assert tolerance_for([]) == TOLERANCE[torch.float32]
    assert list(TOLERANCE.values()) == sorted(TOLERANCE.values())    # float64 strictest, bfloat16 loosest


def test_the_checks_rows_hold_their_adversarial_cases() -> None:
    row = selfcheck_layout(edge=64, reach=4)
    assert row.lengths == (1, 63, 65, 1, 195, 5) and row.num_pad_tokens == 5
    assert row.total_tokens == 5 * 64 + 4 + 11
    boundaries = row.boundaries()
    assert boundaries.starts[2] == 64 and boundaries.num_docs == 6     # a document ends exactly on the edge
    cp = adversarial_cp_row(world_size=4)
    assert cp.total_tokens == 4 * 128 and cp.starts[:3] == [0, 1, 127] and cp.num_pad_tokens == 26
    assert cp.starts[3] == 128                                          # a one-token document starts a rank


def test_a_layout_names_the_field_it_refuses() -> None:
    assert Layout("list given", [2, 3]).lengths == (2, 3)
    with pytest.raises(InputError, match="lengths"):
        Layout("empty document", (2, 0))
    with pytest.raises(InputError, match="num_pad_tokens"):
        Layout("negative padding", (2,), num_pad_tokens=-1)


def test_the_engine_sits_low_in_the_data_flow() -> None:
    """Importing it loads nothing above the boundaries: every check, however high, may build on it."""
    code = "import sys, hybrid_pack.isolation; print(' '.join(m for m in sys.modules if m.startswith('hybrid_pack')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    allowed = ("hybrid_pack.boundaries", "hybrid_pack.errors", "hybrid_pack.schema", "hybrid_pack.isolation",
               "hybrid_pack.lazy")
    assert [m for m in loaded if m != "hybrid_pack" and not m.startswith(allowed)] == []
