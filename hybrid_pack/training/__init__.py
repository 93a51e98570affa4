"""Packed supervised fine-tuning (``hybrid-pack train`` / ``hybrid-pack demo``)."""

from hybrid_pack.training.config import TrainConfig
from hybrid_pack.training.padded import PaddingCollator
from hybrid_pack.training.trainer import IsolationFailed, build_model, train

__all__ = ["TrainConfig", "PaddingCollator", "IsolationFailed", "build_model", "train"]
