"""Packed layouts chosen to break boundary handling: one-token documents, boundaries at and
around the chunk sizes and conv widths a model uses, a long document beside short ones, and a
trailing padding segment."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybrid_pack.boundaries import PackedBoundaries

_CHUNK_ATTRS = ("chunk_size", "mamba_chunk_size", "ssd_chunk_size")
_CONV_ATTRS = ("conv_kernel", "conv_width", "linear_conv_kernel_dim", "mamba_d_conv", "conv_L_cache", "d_conv",
               "mamba_conv_kernel", "ssm_conv_kernel", "gdn_conv_width", "mamba_conv_width")


@dataclass(frozen=True)
class Layout:
    """A named list of document lengths, plus the tokens of a trailing padding segment (0 = none)."""

    name: str
    lengths: tuple[int, ...]
    num_pad_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths) + self.num_pad_tokens

    def boundaries(self, device: torch.device | str | None = None) -> PackedBoundaries:
        """The packed row's boundaries: these documents, then the padding segment."""
        return PackedBoundaries.from_document_lengths(self.lengths, num_pad_tokens=self.num_pad_tokens,
                                                      device=device)


def model_geometry(model: torch.nn.Module) -> tuple[list[int], list[int]]:
    """Chunk sizes and conv widths a model uses, read from its config and its Conv1d modules."""
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

    Layouts longer than ``max_tokens`` are left out (long-chunk models get their edge cases through
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
