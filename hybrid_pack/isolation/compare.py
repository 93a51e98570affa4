"""The comparison every "packed equals alone" check makes, and the gradient that must stay inside its segment.

* :func:`relative_error`: the one error measure, scale-free, so one tolerance per dtype serves outputs of any
  magnitude (logits, hidden states, log-probabilities, losses, a kernel's outputs and gradients);
* :func:`compare`: a list of outputs against the expected ones, raising :class:`Mismatch` naming the first
  that differs beyond the tolerance and by how much;
* :func:`leaked_gradient` / :func:`assert_gradient_inside`: the gradient of one segment's outputs outside
  that segment's span, which must be exactly zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["Mismatch", "assert_gradient_inside", "compare", "leaked_gradient", "relative_error"]

_ZERO = 1e-12
"""The largest expected magnitude that counts as zero: the error is then the difference over this."""


class Mismatch(AssertionError):
    """Outputs that differ beyond their tolerance, or a gradient that leaves its segment.

    Attributes:
        what: the quantity, e.g. ``"document 3 (5 tokens) alone against packed: output 0"``.
        error: the relative error measured (:func:`relative_error`), or the largest leaked gradient; infinite
            for a non-finite value or a shape that differs.
        tolerance: the largest error accepted (0.0 for a gradient, which must be exactly zero).
    """

    def __init__(self, message: str, *, what: str, error: float, tolerance: float) -> None:
        super().__init__(message)
        self.what, self.error, self.tolerance = what, error, tolerance


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max |actual - expected| / max |expected|``, in float64: the error measure of every isolation check.

    Args:
        actual: any shape and floating dtype: the packed row's values, a kernel's output.
        expected: the same shape: the document run alone, the reference backend's output.

    Returns:
        0.0 for empty tensors; infinite when the shapes differ or either side holds a non-finite value. An
        all-zero ``expected`` (below 1e-12) makes it the difference over 1e-12.
    """
    if actual.shape != expected.shape:
        return float("inf")
    if actual.numel() == 0:
        return 0.0
    expected = expected.detach().double()
    diff = (actual.detach().double() - expected).abs()
    if not torch.isfinite(diff).all():
        return float("inf")
    return diff.max().item() / max(expected.abs().max().item(), _ZERO)


def compare(what: str, actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], tolerance: float, *,
            names: Sequence[str] | None = None) -> float:
    """Every ``actual[i]`` within ``tolerance`` of ``expected[i]`` (:func:`relative_error`).

    Args:
        what: names the comparison in a failure, e.g. ``"against the pure-torch backend"``.
        actual: the outputs under test (tensors of any shape and floating dtype).
        expected: as many outputs, each of its counterpart's shape.
        tolerance: the largest relative error accepted (:data:`~hybrid_pack.isolation.TOLERANCE`).
        names: one name per output for the message (default ``"output <i>"``).

    Returns:
        The largest relative error.

    Raises:
        Mismatch: the counts or a shape differ, or an output differs beyond ``tolerance`` (the first one).
    """
    if len(actual) != len(expected):
        raise Mismatch(f"{what}: returned {len(actual)} outputs, expected {len(expected)}", what=what,
                       error=float("inf"), tolerance=tolerance)
    names = names if names is not None else [f"output {i}" for i in range(len(actual))]
    worst = 0.0
    for name, a, e in zip(names, actual, expected, strict=True):
        if a.shape != e.shape:
            raise Mismatch(f"{what}: {name} has shape {list(a.shape)}, expected {list(e.shape)}",
                           what=f"{what}: {name}", error=float("inf"), tolerance=tolerance)
        error = relative_error(a, e)
        if not error <= tolerance:
            raise Mismatch(f"{what}: {name} differs by {error:.3g} (tolerance {tolerance:.0e})",
                           what=f"{what}: {name}", error=error, tolerance=tolerance)
        worst = max(worst, error)
    return worst


def leaked_gradient(grad: torch.Tensor, span: slice, dim: int = 0) -> float:
    """The largest ``|grad|`` outside ``span`` along ``dim``: exactly 0.0 when nothing leaked.

    Args:
        grad: a gradient, e.g. ``[1, T, ...]`` per token (``dim=1``), ``[T, E]`` (``dim=0``) or one row per
            document ``[N, ...]`` (``dim=0``, ``span`` the document's row).
        span: the segment's indices along ``dim`` (``start`` and ``stop`` set).
        dim: the axis ``span`` indexes.

    Returns:
        0.0, the largest magnitude outside the span, or infinite for a non-finite value there.
    """
    size = grad.shape[dim]
    start, stop = span.start, min(span.stop, size)
    outside = torch.cat([grad.narrow(dim, 0, start), grad.narrow(dim, stop, size - stop)], dim=dim).detach()
    if outside.numel() == 0:
        return 0.0
    if not torch.isfinite(outside).all():
        return float("inf")
    return outside.abs().max().item()


def assert_gradient_inside(what: str, grad: torch.Tensor, span: slice, dim: int = 0) -> None:
    """``grad`` is exactly zero outside ``span`` along ``dim`` (:func:`leaked_gradient`).

    Raises:
        Mismatch: naming ``what`` and the largest leaked value.
    """
    leak = leaked_gradient(grad, span, dim)
    if leak != 0.0:
        raise Mismatch(f"{what} (max {leak:.3g}; must be exactly 0)", what=what, error=leak, tolerance=0.0)
