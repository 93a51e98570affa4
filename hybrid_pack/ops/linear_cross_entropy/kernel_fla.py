"""flash-linear-attention adapter: the fused linear cross-entropy (``fused_linear_cross_entropy_loss``).

fla computes each chunk's logits, loss and gradients in its forward pass (Liger-Kernel's scheme) and keeps the
gradients, not the logits, for its backward pass, which only scales them by the incoming gradient. It splits the
tokens into ``ceil(N / chunk_size)`` chunks, rounded to a power-of-two chunk length (at most ``2 * chunk_size``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.ops.compiler import disable
from hybrid_pack.schema import IGNORE_INDEX

__all__ = ["linear_cross_entropy_sum", "fla_accepts"]


def fla_accepts(inputs: Mapping[str, Any]) -> str:
    """"" if fla's fused linear cross-entropy takes these inputs, else why not."""
    if inputs["hidden"].shape[0] == 0:
        return "fla's fused linear cross-entropy needs at least one token"
    return ""


@disable  # fla's autograd function launches Triton kernels on raw pointers
def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                             chunk_size: int) -> torch.Tensor:
    """:func:`~hybrid_pack.ops.linear_cross_entropy.torch_backend.linear_cross_entropy_sum` through fla's
    ``fused_linear_cross_entropy_loss(reduction="sum")``: a float32 scalar."""
    from fla.modules.fused_linear_cross_entropy import fused_linear_cross_entropy_loss

    num_chunks = -(-hidden.shape[0] // chunk_size)
    return fused_linear_cross_entropy_loss(hidden, targets, weight, ignore_index=IGNORE_INDEX, reduction="sum",
                                           num_chunks=num_chunks)
