"""Packed layouts chosen to break boundary handling, for every check and benchmark in one place.

A :class:`Layout` is a named list of document lengths plus the tokens of a trailing padding segment. The
cases every generator draws on: one-token documents; documents ending exactly on, one short of and one past
a kernel's block edge (a chunk of a chunked recurrence, an attention tile); documents around a conv's reach
(its width); a document over several blocks beside short ones; a trailing padding segment.

* :func:`adversarial_layouts`: the harness's layouts for the chunk sizes and conv widths a model uses
  (:func:`model_geometry`);
* :func:`selfcheck_layout`: the backends' self-check row, every case in one short row;
* :func:`adversarial_cp_row`: the context-parallel check's row, its rank edges among the cases;
* :func:`real_size_layout`, :func:`short_document_layout`, :func:`one_document_layout`: rows at real sizes,
  for the GPU test tier and the kernel benchmarks.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import InputError

__all__ = ["Layout", "MIN_REAL_TOKENS", "REAL_TOKENS", "adversarial_cp_row", "adversarial_layouts", "model_geometry",
           "one_document_layout", "real_size_layout", "selfcheck_layout", "short_document_layout"]


@dataclass(frozen=True)
class Layout:
    """A named list of document lengths, plus the tokens of a trailing padding segment (0 = none).

    ``lengths`` may be given as any sequence of ints >= 1 (none: a row of padding only); it is kept as a tuple.
    """

    name: str
    lengths: tuple[int, ...]
    num_pad_tokens: int = 0

    def __post_init__(self) -> None:
        lengths = tuple(int(n) for n in self.lengths)
        if lengths and min(lengths) < 1:
            raise InputError(f"lengths: expected document lengths >= 1; got {list(self.lengths)}")
        if self.num_pad_tokens < 0:
            raise InputError(f"num_pad_tokens: expected 0 (no padding) or more tokens; got {self.num_pad_tokens}")
        object.__setattr__(self, "lengths", lengths)

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths) + self.num_pad_tokens

    def boundaries(self, device: torch.device | str | None = None) -> PackedBoundaries:
        """The packed row's boundaries: these documents, then the padding segment."""
        return PackedBoundaries.from_document_lengths(self.lengths, num_pad_tokens=self.num_pad_tokens,
                                                      device=device)


# ---------------------------------------------------------------- the harness: a model's geometry
_CHUNK_ATTRS = ("chunk_size", "mamba_chunk_size", "ssd_chunk_size")
_CONV_ATTRS = ("conv_kernel", "conv_width", "linear_conv_kernel_dim", "mamba_d_conv", "conv_L_cache", "d_conv",
               "mamba_conv_kernel", "ssm_conv_kernel", "gdn_conv_width", "mamba_conv_width")


def model_geometry(model: torch.nn.Module) -> tuple[list[int], list[int]]:
    """Chunk sizes (64 always among them) and conv widths (4 when none is found) a model uses, read from its
    config (and its ``text_config`` / ``ssm_cfg``) and its ``Conv1d`` modules."""
    config = getattr(model, "config", None)
    configs = [config] + [getattr(config, name, None) for name in ("text_config", "ssm_cfg")] if config else []
    chunks: set[int] = {64}
    widths: set[int] = set()
    for cfg in filter(None, configs):
        for attr in _CHUNK_ATTRS:
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 1:
                chunks.add(value)
        for attr in _CONV_ATTRS:
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 1:
                widths.add(value)
    for module in model.modules():
        if isinstance(module, torch.nn.Conv1d) and module.kernel_size[0] > 1:
            widths.add(module.kernel_size[0])
    return sorted(chunks), sorted(widths or {4})


def adversarial_layouts(chunk_sizes: Iterable[int] = (64,), conv_widths: Iterable[int] = (4,),
                        max_tokens: int = 512) -> list[Layout]:
    """Layouts that exercise every boundary case for these chunk sizes and conv widths.

    One-token documents; lengths ``W - 1, W, W + 1`` for every conv width ``W``; per chunk size ``C``,
    lengths ``C, C - 1, 1, C + 1`` and a document longer than ``3C`` beside short ones; a trailing padding
    segment. Layouts longer than ``max_tokens`` are left out (long-chunk models get their edge cases through
    the smallest chunk size that fits).
    """
    widths = sorted(set(conv_widths))
    w = max(widths)
    layouts = [
        Layout("one-token documents", (1, 1, 1, 2, 1, 3, 1)),
        Layout("conv width edges", (*(x for v in widths for x in (max(v - 1, 1), v, v + 1)), 1, 2)),
    ]
    for c in sorted(set(chunk_sizes)):
        layouts += [
            Layout(f"boundaries at chunk {c}", (c, c - 1, 1, c + 1, 2)),
            Layout(f"long beside short (chunk {c})", (3 * c + 5, 1, 2, w, c - 1)),
        ]
    layouts.append(Layout("trailing padding", (5, 9, 1, 17), num_pad_tokens=11))
    return [layout for layout in layouts if layout.total_tokens <= max_tokens]


# ---------------------------------------------------------------- the backends' checks
_SELFCHECK_PADDING = 5


def selfcheck_layout(edge: int, reach: int) -> Layout:
    """The self-check's row for block length ``edge`` (>= 2) and conv reach ``reach``: seven segments.

    A one-token document first, then one ending exactly on a block edge, one crossing the next edge by a
    token, another one-token document, one over three blocks long beside it (so two whole blocks lie inside
    one document wherever it starts), one just past the reach, and a trailing padding segment of 5 tokens:
    ``5 * edge + reach + 11`` tokens (335 for 64-token chunks and a width-4 conv).
    """
    return Layout(f"self-check row (edge {edge}, reach {reach})", (1, edge - 1, edge + 1, 1, 3 * edge + 3, reach + 1),
                  num_pad_tokens=_SELFCHECK_PADDING)


_CP_TOKENS_PER_RANK = 128


def adversarial_cp_row(world_size: int, device: torch.device | str | None = None) -> PackedBoundaries:
    """The context-parallel check's row, ``world_size * 128`` tokens to be split evenly across the ranks.

    A one-token document ending on the first rank edge and one starting there, a document crossing every
    later edge, a short one, and 26 tokens of padding.
    """
    per_rank = _CP_TOKENS_PER_RANK
    total = world_size * per_rank
    documents = (1, per_rank - 2, 1, 1, total - per_rank - 40, 13)
    return Layout(f"context-parallel row ({world_size} ranks)", documents,
                  num_pad_tokens=total - sum(documents)).boundaries(device)


# ---------------------------------------------------------------- real sizes: GPU tier, benchmarks
REAL_TOKENS = 32_768
MIN_REAL_TOKENS = 8192
"""The shortest row :func:`real_size_layout` builds (its fixed documents need it)."""
_REAL_SIZE_PADDING = 7
_SHORT_DOCUMENTS = (1, 2, 5, 17, 31, 63, 40, 9, 1, 48)
"""Documents under 64 tokens, repeated where a row needs many."""


def real_size_layout(edge: int, total: int = REAL_TOKENS) -> Layout:
    """A ``total``-token row (``total`` >= 8192) of every case at real size.

    One-token documents, documents ending on the kernel's block edges (``edge``), a long document (4096
    tokens, or ``total / 8``) beside short ones, a run of documents under 64 tokens, then mid-sized
    documents up to the row's end, and 7 tokens of padding.

    Raises:
        InputError: ``total`` under 8192.
    """
    if total < MIN_REAL_TOKENS:
        raise InputError(f"total: expected at least {MIN_REAL_TOKENS} tokens (the layout's fixed documents need them); "
                         f"got {total}")
    documents = [1, edge - 1, edge + 1, 1, edge, 2 * edge, min(4096, total // 8), 1, 3 * edge - 1,
                 *_SHORT_DOCUMENTS * 8]
    for length in itertools.cycle((700, 1500, 333, 2048, 129)):
        room = total - _REAL_SIZE_PADDING - sum(documents)
        if room <= 0:
            break
        documents.append(min(length, room))
    return Layout(f"real size (edge {edge})", documents, num_pad_tokens=_REAL_SIZE_PADDING)


def short_document_layout(total: int = REAL_TOKENS) -> Layout:
    """A ``total``-token row of documents under 64 tokens only (the case where per-document overheads show)."""
    documents: list[int] = []
    for length in itertools.cycle(_SHORT_DOCUMENTS):
        room = total - sum(documents)
        if room <= 0:
            break
        documents.append(min(length, room))
    return Layout("short documents", documents)


def one_document_layout(total: int = REAL_TOKENS) -> Layout:
    """The same tokens as one document: the baseline boundaries are measured against."""
    return Layout("one document", (total,))
