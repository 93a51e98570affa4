"""The one tolerance table of every "packed equals alone" check.

The backends' self-check, the context-parallel collective check, the harness, the training-step check and
the runtime guard all measure a difference with :func:`~hybrid_pack.isolation.relative_error` (the largest
absolute difference over the largest magnitude expected) and accept it up to :data:`TOLERANCE` of the least
precise dtype involved (:func:`tolerance_for`). A gradient that crosses from one segment to another is not
judged against this table: it must be exactly zero.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["GRADIENT_FACTOR", "SELF_CHECK_TOLERANCE", "TOLERANCE", "least_precise", "self_check_tolerance",
           "tolerance_for"]

TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 5e-3,
    torch.float16: 1e-2,
    torch.bfloat16: 5e-2,
}
"""Largest relative error rounding alone may cause, per dtype.

It bounds the error between two computations of the same values in that dtype that round differently: a
kernel against the pure-torch backend run in float64 (self-check, context-parallel check), or a document
in a packed row against the same document run alone, where tiles, chunk offsets and reduction orders
differ (harness, training step, guard). A leak, one document reading another's tokens or state, moves the
outputs by a share of their own magnitude, far above these bounds; a leak small enough to hide below them
still fails the gradient checks, which require exactly zero.

* float32 5e-3: float32 kernels multiply in TF32 on GPUs (10-bit mantissa, 4.9e-4 per rounding) and a
  chunked recurrence compounds it over its chunks.
* bfloat16 5e-2: 8-bit mantissa (3.9e-3 per rounding), compounded over every layer of a model under
  autocast, where a packed row and a lone document round at different points.
* float16 1e-2: 11-bit mantissa, with the same compounding as float32 kernels.
* float64 1e-9: reduction order only.

Another floating dtype is judged as float32.
"""

SELF_CHECK_TOLERANCE: dict[torch.dtype, float] = {**TOLERANCE, torch.float32: 1e-5}
"""Largest relative error a backend's self-check accepts against the float64 oracle (docs/api.md §5a), per dtype.

One op call on one adversarial row, no model around it, so float32 is held to what the kernels reach: on CPU (Triton
interpreter, fla 0.6, mamba-ssm 2.3) every float32 backend is within 1.3e-6 of the oracle (the largest: the SSD,
1.06e-6 for mamba-ssm's kernel, 1.28e-6 for the pure-torch chunked form). 1e-5 leaves them an eightfold margin and
refuses a kernel 0.1 % off by a factor of 100. A Triton kernel that multiplies float32 in TF32 on a GPU (about 5e-4
per rounding) fails it and the pure-torch backend serves float32 calls instead; half-precision calls keep
:data:`TOLERANCE`'s bounds, which their own rounding sets.
"""

GRADIENT_FACTOR = 2.0
"""A kernel's gradients against the reference's are held to this multiple of :data:`TOLERANCE`: a backward pass
runs about twice the roundings of its forward."""


def least_precise(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The floating dtype with the largest tolerance among ``dtypes`` (others ignored); float32 when none is."""
    floating = [dtype for dtype in dtypes if dtype.is_floating_point]
    return max(floating, key=_tolerance_of, default=torch.float32)


def tolerance_for(dtypes: Iterable[torch.dtype]) -> float:
    """The tolerance of the least precise floating dtype among ``dtypes`` (float32's when none is floating)."""
    return _tolerance_of(least_precise(dtypes))


def self_check_tolerance(dtypes: Iterable[torch.dtype]) -> float:
    """:data:`SELF_CHECK_TOLERANCE` of the least precise floating dtype among ``dtypes``."""
    dtype = least_precise(dtypes)
    return SELF_CHECK_TOLERANCE.get(dtype, SELF_CHECK_TOLERANCE[torch.float32])


def _tolerance_of(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, TOLERANCE[torch.float32])
