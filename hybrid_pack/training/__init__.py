"""Packed supervised fine-tuning (``hybrid-pack train`` / ``hybrid-pack demo``).

``IsolationFailed`` is :class:`hybrid_pack.errors.IsolationError` under the name this module always used. The
settings import alone (the command line builds its options from them); the trainer is imported on first use.
"""

from __future__ import annotations

from hybrid_pack.lazy import lazy_attributes
from hybrid_pack.training.config import DEFAULT_GUARD_EVERY, TrainConfig

_LAZY = {
    "IsolationFailed": "hybrid_pack.training.trainer",
    "build_model": "hybrid_pack.training.trainer",
    "train": "hybrid_pack.training.trainer",
    "PaddingCollator": "hybrid_pack.training.padded",
}

__all__ = ["DEFAULT_GUARD_EVERY", "IsolationFailed", "PaddingCollator", "TrainConfig", "build_model", "train"]

__getattr__ = lazy_attributes(__name__, _LAZY)
