"""A packed row's segment lengths on the host, handed over with the batch (docs/api.md §9, §9b).

The collator knows every segment's length on the host. It puts them in the batch under ``host_boundaries``
so that a model whose tensors are on an accelerator builds its :class:`~hybrid_pack.PackedBoundaries` from
them and the batch's boundary tensors, reading no tensor value (no device-to-host copy, no synchronisation).
The object holds no tensor and has no ``.to``: ``transformers.Trainer._prepare_inputs``, accelerate's
``send_to_device`` (which calls ``.to`` on whatever has one), ``DataLoader(pin_memory=True)`` and TRL pass it
through as it is.

It describes the tensors it was collated with, and only those: a batch whose tokens or boundary keys are
sliced, concatenated or edited must drop it (``batch.pop("host_boundaries")``), and the boundaries are then
read from the tensors. The shapes are checked against it (never the values).

The static form (docs/api.md §9) carries a :class:`StaticHostBoundaries` instead: the same row as host (CPU)
tensors of fixed shapes, which a compiled graph takes as inputs (Python ints would be constants of the graph, one
recompile per layout) and the ops read there, never on the device.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hybrid_pack.errors import BoundaryError
from hybrid_pack.schema import HOST_BOUNDARIES

__all__ = ["HostBoundaries", "StaticHostBoundaries"]


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


class StaticHostBoundaries:
    """The host entry of a static batch: its boundaries as CPU tensors of the batch's static shapes.

    Attributes:
        cu_seqlens: int32 CPU ``[M + 2]``: the values of the batch's ``cu_seq_lens_q`` (unused slots repeat ``T``).
        num_pad_tokens: int64 CPU 0-d: the batch's ``num_pad_tokens``.

    Like :class:`HostBoundaries` it has no ``.to`` (the movers pass it through, the tensors stay on the host).
    """

    __slots__ = ("cu_seqlens", "num_pad_tokens")

    def __init__(self, cu_seqlens: torch.Tensor, num_pad_tokens: torch.Tensor) -> None:
        for name, tensor, dtype, ndim in (("cu_seqlens", cu_seqlens, torch.int32, 1),
                                          ("num_pad_tokens", num_pad_tokens, torch.int64, 0)):
            if (not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or tensor.dtype != dtype
                    or tensor.dim() != ndim):
                raise BoundaryError(f"{HOST_BOUNDARIES}.{name}: expected a {dtype} CPU tensor of {ndim} dims (as "
                                    f"PackingCollator(pack_length=..., max_documents=...) builds it); got "
                                    f"{getattr(tensor, 'dtype', type(tensor).__name__)} on "
                                    f"{getattr(tensor, 'device', '-')}")
        self.cu_seqlens = cu_seqlens
        self.num_pad_tokens = num_pad_tokens

    def lengths(self) -> HostBoundaries:
        """The row's segments as Python ints, the unused slots left out (reads these host tensors only)."""
        cu = self.cu_seqlens.tolist()
        if len(cu) < 2 or cu[0] != 0:
            raise BoundaryError(f"{HOST_BOUNDARIES}.cu_seqlens: expected [0, ..., T] (0 first, at least two entries); "
                                f"got {cu[:8]}")
        used = cu.index(cu[-1])
        return HostBoundaries(tuple(b - a for a, b in itertools.pairwise(cu[:used + 1])), int(self.num_pad_tokens))

    def __repr__(self) -> str:
        return f"StaticHostBoundaries(slots={self.cu_seqlens.shape[0] - 1})"
