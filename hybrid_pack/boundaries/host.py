"""HostBoundaries: a packed row's segment lengths as Python ints, handed over with the batch (docs/api.md §9b).

The collator knows every segment's length on the host. It puts them in the batch under ``host_boundaries``
so that a model whose tensors are on an accelerator builds its :class:`~hybrid_pack.PackedBoundaries` from
them and the batch's boundary tensors, reading no tensor value (no device-to-host copy, no synchronisation).
The object holds no tensor and has no ``.to``: ``transformers.Trainer._prepare_inputs``, accelerate's
``send_to_device`` (which calls ``.to`` on whatever has one), ``DataLoader(pin_memory=True)`` and TRL pass it
through as it is.

It describes the tensors it was collated with, and only those: a batch whose tokens or boundary keys are
sliced, concatenated or edited must drop it (``batch.pop("host_boundaries")``), and the boundaries are then
read from the tensors. The shapes are checked against it (never the values).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_pack.errors import BoundaryError
from hybrid_pack.schema import HOST_BOUNDARIES

__all__ = ["HostBoundaries"]


@dataclass(frozen=True)
class HostBoundaries:
    """The segments of one packed row, on the host.

    Attributes:
        segment_lengths: every segment's length (Python ints), the trailing padding segment (if any) last.
        num_pad_tokens: tokens of the trailing padding segment (0: none).
    """

    segment_lengths: tuple[int, ...]
    num_pad_tokens: int = 0

    def __post_init__(self) -> None:
        lengths = self.segment_lengths
        if (not isinstance(lengths, tuple) or not lengths
                or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in lengths)):
            raise BoundaryError(f"{HOST_BOUNDARIES}.segment_lengths: expected a non-empty tuple of positive ints; "
                                f"got {lengths!r}")
        pad = self.num_pad_tokens
        if not isinstance(pad, int) or isinstance(pad, bool) or pad < 0 or (pad and lengths[-1] != pad):
            raise BoundaryError(f"{HOST_BOUNDARIES}.num_pad_tokens: expected 0 or the length of the last segment "
                                f"({lengths[-1]}); got {pad!r}")

    @property
    def total_tokens(self) -> int:
        """T, padding included."""
        return sum(self.segment_lengths)

    @property
    def max_seqlen(self) -> int:
        """The longest segment (padding included, as the kernels count it)."""
        return max(self.segment_lengths)

    @property
    def num_segments(self) -> int:
        """Documents plus the padding segment if any (``cu_seq_lens_q`` has one entry more)."""
        return len(self.segment_lengths)
