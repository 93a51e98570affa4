"""Packed supervised fine-tuning (``hybrid-pack train`` / ``hybrid-pack demo``).

``IsolationFailed`` is :class:`hybrid_pack.errors.IsolationError` under the name this module always used.
"""

from hybrid_pack.training.config import DEFAULT_GUARD_EVERY, TrainConfig
from hybrid_pack.training.padded import PaddingCollator
from hybrid_pack.training.trainer import IsolationFailed, build_model, train

__all__ = ["DEFAULT_GUARD_EVERY", "IsolationFailed", "PaddingCollator", "TrainConfig", "build_model", "train"]
