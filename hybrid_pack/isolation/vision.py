"""One document of a packed vision-language row (docs/api.md §3b): its own pixels, grids and M-RoPE positions.

A packed row holds every document's ``pixel_values`` ``[sum P, C]`` concatenated in document order, their
``image_grid_thw`` ``[n, 3]`` stacked in the same order (videos likewise), ``mm_token_type_ids`` ``[1, T]``
(0 text, 1 image, 2 video) and 3-D ``position_ids`` ``[3, 1, T]``. A document run alone needs exactly its own
share of each: :func:`document_vision_inputs` finds it from the token types, the one key that says which
tokens are whose. Each image (video) owns ``t * h * w / r`` placeholder tokens, with one ratio ``r`` per row
(the model's ``spatial_merge_size ** 2``), read from the row itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hybrid_pack.errors import BoundaryError, InputError
from hybrid_pack.schema import (
    IMAGE_GRID_THW,
    MM_TOKEN_TYPE_IDS,
    PIXEL_VALUES,
    PIXEL_VALUES_VIDEOS,
    POSITION_IDS,
    VIDEO_GRID_THW,
)

__all__ = ["VISION_INPUT_KEYS", "document_vision_inputs"]

_MODALITIES = ((PIXEL_VALUES, IMAGE_GRID_THW, 1), (PIXEL_VALUES_VIDEOS, VIDEO_GRID_THW, 2))
VISION_INPUT_KEYS = frozenset({PIXEL_VALUES, IMAGE_GRID_THW, PIXEL_VALUES_VIDEOS, VIDEO_GRID_THW})
"""Keys that are not per token: a document's share is found by :func:`document_vision_inputs`, never sliced."""


def document_vision_inputs(batch: Mapping[str, Any], start: int, length: int) -> dict[str, torch.Tensor]:
    """The vision inputs of the document at tokens ``[start, start + length)`` of a packed row, as it runs alone.

    Args:
        batch: the packed row: ``mm_token_type_ids`` int ``[1, T]`` and, each optional, ``pixel_values``
            ``[P, C]`` with ``image_grid_thw`` int ``[n, 3]``, ``pixel_values_videos`` with ``video_grid_thw``,
            ``position_ids`` ``[3, 1, T]``.
        start: the document's first token.
        length: its token count.

    Returns:
        ``position_ids`` ``[3, 1, length]`` when the row's are 3-D; the document's own ``pixel_values`` rows and
        ``image_grid_thw`` rows (videos likewise) when it has images (videos); nothing else.

    Raises:
        InputError: pixels without ``mm_token_type_ids``, or placeholder counts that no ratio ``t * h * w / r``
            explains.
        BoundaryError: an image (video) whose placeholder tokens cross the document's boundary.
    """
    out: dict[str, torch.Tensor] = {}
    positions = batch.get(POSITION_IDS)
    if isinstance(positions, torch.Tensor) and positions.dim() == 3:
        out[POSITION_IDS] = positions[:, :, start:start + length]
    for pixel_key, grid_key, value in _MODALITIES:
        grid, pixels = batch.get(grid_key), batch.get(pixel_key)
        if grid is None or pixels is None:
            continue
        types = batch.get(MM_TOKEN_TYPE_IDS)
        if types is None:
            raise InputError(f"{MM_TOKEN_TYPE_IDS}: missing, while the batch has {grid_key}; it says which "
                             f"document each image belongs to (PackingCollator keeps it)")
        is_value = (torch.as_tensor(types).reshape(-1) == value).cpu()
        before, inside = int(is_value[:start].sum()), int(is_value[start:start + length].sum())
        sizes = torch.as_tensor(grid).cpu().prod(dim=1)
        tokens = _placeholder_counts(grid_key, sizes, int(is_value.sum()), value)
        token_edges = [0, *tokens.cumsum(0).tolist()]
        if before not in token_edges or before + inside not in token_edges:
            raise BoundaryError(f"{grid_key}: an item's {value}-type placeholder tokens cross the boundary of the "
                                f"document at tokens {start}..{start + length - 1}; an image is never cut (pack "
                                f"whole samples with PackingCollator)")
        first, stop = token_edges.index(before), token_edges.index(before + inside)
        if first == stop:
            continue
        rows = [0, *sizes.cumsum(0).tolist()]
        out[grid_key] = grid[first:stop]
        out[pixel_key] = pixels[rows[first]:rows[stop]]
    return out


def _placeholder_counts(grid_key: str, sizes: torch.Tensor, placeholders: int, value: int) -> torch.Tensor:
    """int64 ``[n]``: placeholder tokens of each item, ``t * h * w / r`` for the row's one ratio ``r``."""
    total = int(sizes.sum())
    ratio = total // placeholders if placeholders else 0
    if not ratio or ratio * placeholders != total or bool((sizes % ratio).any()):
        raise InputError(f"{MM_TOKEN_TYPE_IDS}: {placeholders} tokens of type {value}, which no ratio t * h * w / r "
                         f"explains for {grid_key}={sizes.tolist()} patches (pass the processor's keys unchanged)")
    return sizes // ratio
