"""M-RoPE positions of one sample, by the model's own ``get_rope_index``, for ``PackingCollator(position_ids_fn=...)``.

Qwen3.5 / Qwen3.5-MoE vision-language models (and every model whose inner model class has
``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask=None)``) number
their tokens on three rows (time, height, width): text advances all three, an image's tokens take its grid
coordinates. :func:`mrope_position_ids` returns a :class:`MRopePositions` that computes them for one sample with
the model's own method, run on a weightless stand-in of the inner model (the method reads only ``self.config``
and the class's own methods), so a packed row's positions are exactly what the model computes for each sample
alone. It holds the config only (no weights) and pickles (DataLoader workers).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from hybrid_pack.errors import InputError, UnsupportedModelError

__all__ = ["MRopePositions", "mrope_position_ids", "numbers_with_mrope"]

_REQUIRED_PARAMETERS = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw", "attention_mask")


class MRopePositions:
    """``positions(input_ids [1, L] int64, mm_token_type_ids [1, L] | None, image_grid_thw [n, 3] | None,
    video_grid_thw [m, 3] | None) -> int64 [3, 1, L]``: one sample's M-RoPE positions as the model computes them.

    Without a grid the model numbers the sample ``0..L-1`` on every row (its language model's own positions),
    and so does this; with one, ``model_class.get_rope_index`` runs on a stand-in holding ``config`` alone.

    Attributes:
        model_class: the class that defines ``get_rope_index`` (e.g. ``Qwen3_5Model``).
        config: the model's config (e.g. ``Qwen3_5Config``, with its ``vision_config``).
    """

    def __init__(self, model_class: type, config: Any) -> None:
        self.model_class = model_class
        self.config = config

    def __repr__(self) -> str:
        return f"MRopePositions({self.model_class.__name__})"

    def __call__(self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor | None,
                 image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InputError(f"input_ids: expected one sample, shape [1, L]; got {list(input_ids.shape)}")
        length = input_ids.shape[1]
        if image_grid_thw is None and video_grid_thw is None:
            if mm_token_type_ids is not None and bool((mm_token_type_ids != 0).any()):
                raise InputError("mm_token_type_ids: marks image or video tokens, but the sample has no "
                                 "image_grid_thw / video_grid_thw")
            return torch.arange(length, dtype=torch.int64).expand(3, 1, length)
        if mm_token_type_ids is None:
            raise InputError("mm_token_type_ids: missing for a sample with image_grid_thw / video_grid_thw (the model "
                             "finds its vision tokens by it); keep the processor's mm_token_type_ids")
        self._check_token_counts(mm_token_type_ids, image_grid_thw, video_grid_thw)
        stand_in = object.__new__(self.model_class)  # no __init__: no weights, no module state
        stand_in.__dict__["config"] = self.config
        try:
            positions, _ = self.model_class.get_rope_index(
                stand_in, input_ids, mm_token_type_ids=mm_token_type_ids, image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw, attention_mask=None)
        except (StopIteration, RuntimeError, IndexError) as err:
            raise InputError(f"mm_token_type_ids: {self.model_class.__name__}.get_rope_index could not place the "
                             f"sample's vision tokens ({type(err).__name__}: {err}); the placeholder runs must match "
                             f"image_grid_thw / video_grid_thw") from None
        return positions.to(torch.int64)

    def _check_token_counts(self, mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                            video_grid_thw: torch.Tensor | None) -> None:
        """Placeholders of each modality: ``sum(t * h * w) / spatial_merge_size**2``, as the processor lays them."""
        merge = getattr(getattr(self.config, "vision_config", None), "spatial_merge_size", None)
        if merge is None:
            return
        for value, key, grid in ((1, "image_grid_thw", image_grid_thw), (2, "video_grid_thw", video_grid_thw)):
            expected = 0 if grid is None else int(grid.prod(dim=1).sum()) // merge**2
            got = int((mm_token_type_ids == value).sum())
            if got != expected:
                raise InputError(f"mm_token_type_ids: {got} tokens of type {value}, while {key} "
                                 f"{None if grid is None else grid.tolist()} needs {expected} "
                                 f"(sum(t * h * w) / spatial_merge_size**2, spatial_merge_size={merge})")


def _rope_index_owner(model: Any) -> tuple[type, Any] | None:
    """``(class defining get_rope_index, the module it serves)`` for ``model`` or its inner ``model.model``."""
    for candidate in (model, getattr(model, "model", None)):
        if candidate is None:
            continue
        for cls in type(candidate).__mro__:
            if "get_rope_index" in vars(cls):
                return cls, candidate
    return None


def numbers_with_mrope(model: Any) -> bool:
    """Whether ``model`` (or its inner ``model.model``) numbers its tokens with M-RoPE (has ``get_rope_index``)."""
    return _rope_index_owner(model) is not None


def mrope_position_ids(model: Any) -> MRopePositions:
    """The per-sample position rule of ``model`` (a ``...ForConditionalGeneration`` or its inner model), for
    ``PackingCollator(position_ids_fn=mrope_position_ids(model))``.

    Raises:
        UnsupportedModelError: the model has no ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw,
            video_grid_thw, attention_mask)`` (no M-RoPE: the collator's default 1-D positions are its own).
    """
    owner = _rope_index_owner(model)
    name = type(model).__name__
    if owner is None:
        raise UnsupportedModelError(f"model: {name} has no get_rope_index (no M-RoPE); leave position_ids_fn=None, "
                                    f"the collator's restarting 1-D positions are the model's")
    cls, inner = owner
    parameters = inspect.signature(cls.get_rope_index).parameters
    missing = [p for p in _REQUIRED_PARAMETERS if p not in parameters]
    if missing:
        raise UnsupportedModelError(f"model: {cls.__name__}.get_rope_index takes no {', '.join(missing)}; "
                                    f"mrope_position_ids serves get_rope_index({', '.join(_REQUIRED_PARAMETERS)})")
    config = getattr(inner, "config", None)
    if config is None:
        raise UnsupportedModelError(f"model: {type(inner).__name__} has no config")
    return MRopePositions(cls, config)
