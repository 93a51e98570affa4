"""Packed rows at real sizes, for the GPU benchmarks and the GPU test tier."""

from __future__ import annotations

import itertools

from hybrid_pack.errors import InputError

__all__ = ["REAL_TOKENS", "real_size_layout", "short_document_layout", "one_document_layout"]

REAL_TOKENS = 32_768
PADDING = 7
SHORT = (1, 2, 5, 17, 31, 63, 40, 9, 1, 48)  # documents under 64 tokens


def real_size_layout(edge: int, total: int = REAL_TOKENS) -> tuple[list[int], int]:
    """Document lengths and padding of a ``total``-token row (``total`` >= 8192): one-token documents, documents
    ending on the kernel's block edges (``edge``), a long document (4096 tokens, or ``total / 8``) beside short
    ones, a run of documents under 64 tokens, then mid-sized documents up to the row's end, and padding."""
    if total < 8192:
        raise InputError(f"total: expected at least 8192 tokens (the layout's fixed documents need them); got {total}")
    documents = [1, edge - 1, edge + 1, 1, edge, 2 * edge, min(4096, total // 8), 1, 3 * edge - 1, *SHORT * 8]
    for length in itertools.cycle((700, 1500, 333, 2048, 129)):
        room = total - PADDING - sum(documents)
        if room <= 0:
            break
        documents.append(min(length, room))
    return documents, PADDING


def short_document_layout(total: int = REAL_TOKENS) -> tuple[list[int], int]:
    """A row of documents under 64 tokens only (the case where per-document overheads show)."""
    documents = []
    for length in itertools.cycle(SHORT):
        room = total - sum(documents)
        if room <= 0:
            break
        documents.append(min(length, room))
    return documents, 0


def one_document_layout(total: int = REAL_TOKENS) -> tuple[list[int], int]:
    """The same tokens as one document: the baseline boundaries are measured against."""
    return [total], 0
