"""Compute precision: half and bf16 activations are upcast to float32 for sensitive steps, while
float32 and float64 stay as they are (a float64 model is the exact reference in tests)."""

from __future__ import annotations

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32 (float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
