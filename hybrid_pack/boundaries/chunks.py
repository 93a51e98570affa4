"""Documents cut into fixed-size chunks, laid out for a document-parallel chunked scan.

Chunked recurrences (Gated DeltaNet, SSD) compute each chunk's intra-chunk part in parallel and
pass a state from chunk to chunk. In a packed row no chunk may straddle two documents, so every
segment is cut on its own into ``ceil(L / C)`` chunks (the last one partial, its tail masked).

Rows are ordered *step-major*: chunk 0 of every segment, then chunk 1 of the segments that have
one, and so on. Segments are ranked by chunk count, longest first, so the segments still running
at step ``k`` are always a prefix of that ranking: the scan over steps updates ``state[:active]``
and the loop runs ``ceil(max_seqlen / C)`` times however many documents the row holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ChunkLayout", "build_chunk_layout", "build_kernel_chunk_index"]


@dataclass(frozen=True, eq=False)
class ChunkLayout:
    """Index tensors mapping a packed row to chunk rows and back.

    Attributes:
        token_index: int64 ``[M, C]``, packed position of each slot (0 for masked slots).
        valid: bool ``[M, C]``, slot holds a token.
        slot_of_token: int64 ``[T]``, flat slot (``row * C + col``) of each packed token.
        step_offsets: rows of step ``k`` are ``step_offsets[k]:step_offsets[k + 1]``; the ``j``-th of
            them is chunk ``k`` of segment ``order[j]``.
        order: int64 ``[S]``, segment ids ranked by chunk count (longest first).
        rank_of_segment: int64 ``[S]``, inverse of ``order``.
        chunk_size: C.
    """

    token_index: torch.Tensor
    valid: torch.Tensor
    slot_of_token: torch.Tensor
    step_offsets: tuple[int, ...]
    order: torch.Tensor
    rank_of_segment: torch.Tensor
    chunk_size: int

    @property
    def num_rows(self) -> int:
        return self.token_index.shape[0]

    @property
    def num_steps(self) -> int:
        return len(self.step_offsets) - 1

    def active(self, step: int) -> int:
        """Segments still running at ``step`` (the first ``active`` of ``order``)."""
        return self.step_offsets[step + 1] - self.step_offsets[step]

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` -> ``[M, C, ...]``, zeros in masked slots.

        Masked slots are filled with ``torch.where``, not a multiplication by the mask: ``0 * inf`` is NaN,
        and a NaN in a masked slot would reach the other documents through the chunk's matmuls (and its
        gradient would reach token 0).
        """
        out = x[self.token_index]
        mask = self.valid.view(*self.valid.shape, *([1] * (x.dim() - 1)))
        return torch.where(mask, out, out.new_zeros(()))

    def from_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """``[M, C, ...]`` -> ``[T, ...]`` (masked slots dropped)."""
        return y.reshape(-1, *y.shape[2:])[self.slot_of_token]


def build_chunk_layout(segment_lengths: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    """The layout of segments with these lengths cut into chunks of ``chunk_size`` tokens; built on the host."""
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    n_chunks = -(-lengths // chunk_size)
    order = np.argsort(-n_chunks, kind="stable")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    counts = np.bincount(np.concatenate([np.arange(n) for n in n_chunks]), minlength=int(n_chunks.max()))
    step_offsets = np.concatenate([[0], np.cumsum(counts)])
    # Row of (step k, rank j) is step_offsets[k] + j; rank j runs over segments with > k chunks.
    ranked_chunks = n_chunks[order]
    steps = np.concatenate([np.arange(n) for n in ranked_chunks])
    ranks = np.repeat(np.arange(len(order)), ranked_chunks)
    rows = step_offsets[steps] + ranks
    chunk_start = np.empty(int(step_offsets[-1]), dtype=np.int64)
    chunk_len = np.empty_like(chunk_start)
    seg = order[ranks]
    chunk_start[rows] = starts[seg] + steps * chunk_size
    chunk_len[rows] = np.minimum(chunk_size, lengths[seg] - steps * chunk_size)
    cols = np.arange(chunk_size)
    valid = cols[None, :] < chunk_len[:, None]
    token_index = np.where(valid, chunk_start[:, None] + cols[None, :], 0)
    slot_of_token = np.empty(int(lengths.sum()), dtype=np.int64)
    slot_of_token[token_index[valid]] = np.flatnonzero(valid)
    rank_of_segment = np.empty_like(order)
    rank_of_segment[order] = np.arange(len(order))

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    return ChunkLayout(put(token_index), put(valid), put(slot_of_token), tuple(int(s) for s in step_offsets),
                       put(order), put(rank_of_segment), chunk_size)


def build_kernel_chunk_index(segment_lengths: tuple[int, ...], chunk_size: int,
                             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chunk_indices, cu_seqlens_cpu)`` as flash-linear-attention's varlen kernels take them.

    ``chunk_indices`` is int32 ``[num_chunks, 2]`` on ``device``: ``(segment, chunk within it)`` for every
    ``chunk_size``-token chunk of every segment; ``cu_seqlens_cpu`` is int64 ``[S + 1]`` on the host. fla
    derives both from ``cu_seqlens`` on the device (a host sync) when they are not given.
    """
    lengths = np.asarray(segment_lengths, dtype=np.int64)
    chunks = -(-lengths // chunk_size)
    segment = np.repeat(np.arange(lengths.size, dtype=np.int64), chunks)
    first_chunk = np.repeat(np.cumsum(chunks) - chunks, chunks)
    within = np.arange(segment.size, dtype=np.int64) - first_chunk
    chunk_indices = torch.from_numpy(np.stack([segment, within], 1).astype(np.int32)).to(device, non_blocking=True)
    cu_seqlens_cpu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))
    return chunk_indices, cu_seqlens_cpu
