"""The collator's explicit boundary keys as a patched layer sees them: which a call carries, and the error of a layer
reached by them without ``boundaries``."""

from __future__ import annotations

from typing import Any

from hybrid_pack.errors import BoundaryError
from hybrid_pack.schema import BOUNDARY_KEYS, POSITION_IDS

__all__ = ["EXPLICIT_BOUNDARY_KEYS", "explicit_keys_in", "stray_keys_error"]

EXPLICIT_BOUNDARY_KEYS = tuple(key for key in BOUNDARY_KEYS if key != POSITION_IDS)
"""Keys that only a packed call carries (``position_ids`` alone is packed only when it restarts)."""


def explicit_keys_in(kwargs: dict[str, Any]) -> list[str]:
    """The explicit boundary keys given a value in ``kwargs``."""
    return [key for key in EXPLICIT_BOUNDARY_KEYS if kwargs.get(key) is not None]


def stray_keys_error(layer: str, keys: list[str]) -> BoundaryError:
    """The error of a patched layer that receives the collator's packed keys instead of ``boundaries``."""
    return BoundaryError(
        f"{layer}: received {', '.join(keys)} but no boundaries, so it would run the packed row as one document. "
        "The keys reached this layer without passing through a patched entry (the model, its backbone or a "
        "decoder layer). Fix: pass the batch to the patched model, model.base_model or a decoder layer, or call "
        "the layer with boundaries=hybrid_pack.PackedBoundaries.from_batch(batch)")
