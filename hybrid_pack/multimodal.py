"""Vision-language samples in a packed row (docs/api.md §3b): their keys, their checks, how they pack.

A processor returns one sample as ``input_ids`` ``[L]`` (image / video placeholder tokens included),
``mm_token_type_ids`` ``[L]`` (0 text, 1 image, 2 video), ``pixel_values`` ``[P, C]`` with
``image_grid_thw`` ``[n, 3]`` (``P = sum(t * h * w)`` over the sample's ``n`` images), and
``pixel_values_videos`` ``[P', C]`` with ``video_grid_thw`` ``[m, 3]``. Any of them is absent (or None)
for a text-only sample. :func:`pack_vision_inputs` checks every sample and builds the packed keys;
:class:`~hybrid_pack.PackingCollator` calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybrid_pack.errors import InputError
from hybrid_pack.schema import IMAGE_GRID_THW, MM_TOKEN_TYPE_IDS, PIXEL_VALUES, PIXEL_VALUES_VIDEOS, VIDEO_GRID_THW

__all__ = ["MULTIMODAL_KEYS", "PositionIdsFn", "is_multimodal", "pack_vision_inputs"]

_MODALITIES = ((PIXEL_VALUES, IMAGE_GRID_THW, 1, "image"), (PIXEL_VALUES_VIDEOS, VIDEO_GRID_THW, 2, "video"))
"""(pixel key, grid key, ``mm_token_type_ids`` value, name) of each modality."""
_VISION_KEYS = (PIXEL_VALUES, IMAGE_GRID_THW, PIXEL_VALUES_VIDEOS, VIDEO_GRID_THW)
MULTIMODAL_KEYS = frozenset({MM_TOKEN_TYPE_IDS, *_VISION_KEYS})
"""The multimodal keys :class:`~hybrid_pack.PackingCollator` takes and packs itself."""

PositionIdsFn = Callable[[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"],
                         torch.Tensor]
"""``fn(input_ids [1, L] int64, mm_token_type_ids [1, L] int64 | None, image_grid_thw [n, 3] int64 | None,
video_grid_thw [m, 3] int64 | None) -> int64 [3, 1, L]``: one sample's positions as the model computes them
for that sample alone (e.g. :func:`hybrid_pack.mrope.mrope_position_ids`)."""


def is_multimodal(example: Mapping[str, Any]) -> bool:
    """True when ``example`` carries pixels or grids (an image or a video): cutting its tokens would cut
    through its images' placeholders, so truncation and splitting refuse it."""
    return any(example.get(key) is not None for key in _VISION_KEYS)


def pack_vision_inputs(docs: Sequence[Mapping[str, Any]], lengths: Sequence[int], num_pad: int,
                       input_ids: torch.Tensor, position_ids_fn: PositionIdsFn | None) -> dict[str, torch.Tensor]:
    """The multimodal keys of a packed row of ``docs`` (``lengths`` tokens each, then ``num_pad`` padding).

    ``input_ids`` is the packed int64 ``[1, T]`` row. Returns, each only when some document carries it:
    ``mm_token_type_ids`` int64 ``[1, T]`` (0 for a document without it and for padding), ``pixel_values`` /
    ``pixel_values_videos`` ``[sum P, C]`` (dtype kept) in document order, ``image_grid_thw`` /
    ``video_grid_thw`` int64 ``[sum n, 3]`` in the same order; and with ``position_ids_fn``, ``position_ids``
    int64 ``[3, 1, T]``: each document's own positions, the padding ``0..num_pad-1`` on every row.

    Raises:
        InputError: naming ``features[i].<key>``: pixels without their grid or a grid without its pixels, a grid
            not ``[n, 3]`` of positive ints, pixel rows that are not ``sum(t * h * w)``, grids without
            ``mm_token_type_ids``, types other than 0 / 1 / 2, image placeholder runs that do not match the
            number of images, placeholder tokens of a modality the sample has no grid for.
    """
    per_doc = [_sample_inputs(i, doc, n) for i, (doc, n) in enumerate(zip(docs, lengths, strict=True))]
    out: dict[str, torch.Tensor] = {}
    if any(types is not None for types, _ in per_doc):
        parts = [types if types is not None else torch.zeros(n, dtype=torch.int64)
                 for (types, _), n in zip(per_doc, lengths, strict=True)]
        out[MM_TOKEN_TYPE_IDS] = torch.cat([*parts, torch.zeros(num_pad, dtype=torch.int64)])[None]
    for pixel_key, grid_key, _, _ in _MODALITIES:
        present = [(i, vision[pixel_key], vision[grid_key]) for i, (_, vision) in enumerate(per_doc)
                   if grid_key in vision]
        if present:
            out[pixel_key] = _cat_pixels(pixel_key, present)
            out[grid_key] = torch.cat([grid for _, _, grid in present])
    if position_ids_fn is not None:
        out["position_ids"] = _position_ids(per_doc, lengths, num_pad, input_ids, position_ids_fn)
    return out


def _sample_inputs(index: int, doc: Mapping[str, Any], length: int
                   ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """``(mm_token_type_ids [L] int64 or None, {key: pixels [P, C] / grid [n, 3] int64})`` of one sample, checked."""
    vision: dict[str, torch.Tensor] = {}
    for pixel_key, grid_key, _, _ in _MODALITIES:
        pixels, grid = doc.get(pixel_key), doc.get(grid_key)
        if pixels is None and grid is None:
            continue
        if grid is None or pixels is None:
            given, missing = (pixel_key, grid_key) if grid is None else (grid_key, pixel_key)
            raise InputError(f"features[{index}].{missing}: missing, while the sample has {given} (the model needs "
                             f"both: give the processor's {pixel_key} and {grid_key} together, or neither)")
        grid = _grid(index, grid_key, grid)
        pixels = _pixels(index, pixel_key, pixels)
        rows = int(grid.prod(dim=1).sum())
        if pixels.shape[0] != rows:
            raise InputError(f"features[{index}].{pixel_key}: expected {rows} rows (sum of t * h * w over "
                             f"{grid_key}={grid.tolist()}); got {pixels.shape[0]} (pass the processor's output "
                             f"for this sample unchanged)")
        vision[pixel_key], vision[grid_key] = pixels, grid
    types = doc.get(MM_TOKEN_TYPE_IDS)
    if types is None:
        if vision:
            key = next(key for key in _VISION_KEYS if key in vision)
            raise InputError(f"features[{index}].{MM_TOKEN_TYPE_IDS}: missing, while the sample has {key}; the model "
                             f"finds its image and video tokens (and their positions) by it: keep the processor's "
                             f"{MM_TOKEN_TYPE_IDS} (return_mm_token_type_ids=True)")
        return None, vision
    types = _token_types(index, types, length)
    for _, grid_key, value, name in _MODALITIES:
        has_tokens = bool((types == value).any())
        if has_tokens != (grid_key in vision):
            raise InputError(f"features[{index}].{MM_TOKEN_TYPE_IDS}: "
                             + (f"marks {name} tokens ({value}) but the sample has no {grid_key}" if has_tokens else
                                f"marks no {name} token ({value}) but the sample has {grid_key}")
                             + " (the placeholders and the pixels must come from the same processor call)")
    if IMAGE_GRID_THW in vision:
        is_image = (types == 1).to(torch.int8)
        runs = int(is_image[0]) + int((is_image[1:] - is_image[:-1] == 1).sum())
        if runs != vision[IMAGE_GRID_THW].shape[0]:
            raise InputError(f"features[{index}].{MM_TOKEN_TYPE_IDS}: expected one run of image tokens per image "
                             f"({vision[IMAGE_GRID_THW].shape[0]} in {IMAGE_GRID_THW}); got {runs} runs")
    return types, vision


def _as_tensor(index: int, key: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        return torch.as_tensor(np.asarray(value))
    except (TypeError, ValueError, RuntimeError) as err:
        raise InputError(f"features[{index}].{key}: expected a tensor, array or nested list; could not read "
                         f"{type(value).__name__} ({err})") from None


def _grid(index: int, key: str, value: Any) -> torch.Tensor:
    grid = _as_tensor(index, key, value)
    integer = not grid.is_floating_point() and grid.dtype != torch.bool
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] == 0 or not integer:
        raise InputError(f"features[{index}].{key}: expected integer (t, h, w) rows, shape [n, 3] with n >= 1; got "
                         f"dtype {grid.dtype}, shape {list(grid.shape)}")
    grid = grid.to(torch.int64)
    if bool((grid < 1).any()):
        raise InputError(f"features[{index}].{key}: expected t, h, w >= 1; got {grid.tolist()}")
    return grid


def _pixels(index: int, key: str, value: Any) -> torch.Tensor:
    pixels = _as_tensor(index, key, value)
    if pixels.dim() != 2:
        raise InputError(f"features[{index}].{key}: expected one row per patch, shape [patches, C]; got shape "
                         f"{list(pixels.shape)} (pass the processor's output for one sample unchanged)")
    return pixels


def _token_types(index: int, value: Any, length: int) -> torch.Tensor:
    types = _as_tensor(index, MM_TOKEN_TYPE_IDS, value)
    if types.shape != (length,) or types.is_floating_point():
        raise InputError(f"features[{index}].{MM_TOKEN_TYPE_IDS}: expected {length} integer values (one per "
                         f"input_ids token, 1-D); got dtype {types.dtype}, shape {list(types.shape)}")
    types = types.to(torch.int64)
    if not bool(((types >= 0) & (types <= 2)).all()):
        raise InputError(f"features[{index}].{MM_TOKEN_TYPE_IDS}: expected 0 (text), 1 (image) or 2 (video); got "
                         f"{sorted(set(types.tolist()) - {0, 1, 2})}")
    return types


def _cat_pixels(key: str, present: list[tuple[int, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    width = present[0][1].shape[1]
    for i, pixels, _ in present:
        if pixels.shape[1] != width:
            raise InputError(f"features[{i}].{key}: expected {width} values per patch (as features[{present[0][0]}]); "
                             f"got {pixels.shape[1]} (use one processor for every sample)")
    return torch.cat([pixels for _, pixels, _ in present])


def _position_ids(per_doc: list[tuple[torch.Tensor | None, dict[str, torch.Tensor]]], lengths: Sequence[int],
                  num_pad: int, input_ids: torch.Tensor, position_ids_fn: PositionIdsFn) -> torch.Tensor:
    """int64 ``[3, 1, T]``: ``position_ids_fn`` of every document alone, then ``0..num_pad-1`` on every row."""
    parts, offset = [], 0
    for i, ((types, vision), n) in enumerate(zip(per_doc, lengths, strict=True)):
        ids = input_ids[:, offset:offset + n]
        positions = position_ids_fn(ids, None if types is None else types[None], vision.get(IMAGE_GRID_THW),
                                    vision.get(VIDEO_GRID_THW))
        if not isinstance(positions, torch.Tensor) or positions.shape != (3, 1, n):
            got = list(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise InputError(f"position_ids_fn: expected a tensor of shape [3, 1, {n}] for features[{i}]; got {got}")
        parts.append(positions.to("cpu", torch.int64))
        offset += n
    parts.append(torch.arange(num_pad, dtype=torch.int64).expand(3, 1, num_pad))
    return torch.cat(parts, dim=2)
