"""The next-token targets of a packed row: its labels shifted by one, never across a document boundary."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_pack.boundaries.packed import PackedBoundaries
from hybrid_pack.schema import IGNORE_INDEX

__all__ = ["shift_labels"]


def shift_labels(labels: torch.Tensor, boundaries: PackedBoundaries | None = None) -> torch.Tensor:
    """The target of every position: ``labels[:, t + 1]`` at ``t``, ``-100`` at the row's last position.

    Args:
        labels: int ``[B, T]``, unshifted.
        boundaries: the row's boundaries; when given, a document's last token gets ``-100`` too (the next
            document's first token is not its target).

    Returns:
        int ``[B, T]`` aligned with the logits: what ``logits[:, t]`` is scored against.
    """
    targets = labels
    if boundaries is not None and boundaries.num_segments > 1:  # a mask, not indices: no data-dependent shape
        starts = boundaries.position_ids.to(labels.device).view(1, -1).expand_as(labels) == 0
        targets = targets.masked_fill(starts, IGNORE_INDEX)
    return F.pad(targets[:, 1:], (0, 1), value=IGNORE_INDEX)
