"""NEFTune on packed rows: each document's embeddings get the noise they would get alone.

transformers' hook (``TrainingArguments(neftune_noise_alpha=...)``) adds uniform noise of magnitude
``alpha / sqrt(L * d)`` to the input embeddings ``[B, L, d]``: on a packed row ``L`` is the whole row, so every
document got the noise of a sequence as long as the row (weaker the more documents it holds). Here each token's
magnitude is ``alpha / sqrt(n * d)`` with ``n`` the length of its own segment (a document, or the padding).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hybrid_pack.boundaries import PackedBoundaries

__all__ = ["PackedNEFTune"]


class PackedNEFTune:
    """The noise hook of one training run: before each forward, :meth:`use` it on the model's input embeddings
    and the packed batch's boundaries; :meth:`detach` it at the end.

    Args:
        alpha: ``neftune_noise_alpha``.
    """

    def __init__(self, alpha: float) -> None:
        self.alpha = float(alpha)
        self._lengths: torch.Tensor | None = None  # float32 [T]: each token's segment length
        self._embeddings: nn.Module | None = None
        self._handle: RemovableHandle | None = None

    def use(self, embeddings: nn.Module, boundaries: PackedBoundaries | None, device: torch.device) -> None:
        """Noise on ``embeddings`` (the model the run trains: ``model_init`` may build it once training starts) for
        the row the next forward embeds (``boundaries`` None: not packed, transformers' own noise)."""
        if embeddings is not self._embeddings:
            self.detach()
            self._embeddings, self._handle = embeddings, embeddings.register_forward_hook(self._hook)
            embeddings.neftune_noise_alpha = self.alpha  # transformers' mark of a noised embedding (the guard reads it)
        if boundaries is None:
            self._lengths = None
            return
        lengths = torch.tensor(boundaries.segment_lengths, dtype=torch.float32)
        self._lengths = lengths.repeat_interleave(lengths.to(torch.int64)).to(device, non_blocking=True)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            del self._embeddings.neftune_noise_alpha
        self._embeddings = self._handle = None

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        width = output.shape[-1]
        lengths = self._lengths
        if lengths is None or output.dim() != 3 or output.shape[0] != 1 or output.shape[1] != lengths.numel():
            magnitude = self.alpha / math.sqrt(output.shape[1] * width)  # not the packed row: [B, L, d]'s noise
            return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)
        magnitude = (self.alpha / torch.sqrt(lengths * width)).to(output.dtype).view(1, -1, 1)
        return output + torch.empty_like(output).uniform_(-1, 1) * magnitude
