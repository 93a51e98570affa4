"""What a training pass measured: losses, tokens, time, and which examples each pack held."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunStats:
    """What one training pass measured.

    Attributes:
        losses: each optimizer step's loss (mean over its target tokens, every rank).
        real_tokens / computed_tokens: tokens that were not padding / every token the model ran on.
        seconds: time in optimizer steps; ``warmup_seconds`` / ``warmup_tokens``: the first step's share.
        groups: example indices of every packed row, in order.
        peak_memory_bytes: the most CUDA memory allocated during the pass (0 off CUDA).
        compiles: graphs ``torch.compile`` compiled during the pass (``--compile``: 1 for the whole model; with the
            blocks compiled one by one, one per block kind and graph break).
        recompiles: graphs compiled after the pass's first step (``--compile``; 0 is the goal: every later row,
            whatever its documents, runs the first step's graphs).
    """

    losses: list[float] = field(default_factory=list)
    real_tokens: int = 0
    computed_tokens: int = 0
    seconds: float = 0.0
    warmup_seconds: float = 0.0
    warmup_tokens: int = 0
    groups: list[list[int]] = field(default_factory=list)
    peak_memory_bytes: int = 0
    compiles: int = 0
    recompiles: int = 0

    @property
    def tokens_per_second(self) -> float:
        """Real (non-padding) tokens per second, the first step (warm-up) excluded when there are more."""
        tokens, seconds = self.real_tokens - self.warmup_tokens, self.seconds - self.warmup_seconds
        if tokens <= 0 or seconds <= 0:
            tokens, seconds = self.real_tokens, self.seconds
        return tokens / seconds if seconds > 0 else 0.0
