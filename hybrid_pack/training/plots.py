"""Plots of a run: the loss curve (packed, and padded when compared) and how full the packs were."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def plot_loss(path: Path, packed: Sequence[float], padded: Sequence[float] | None = None) -> Path:
    """Loss per optimizer step."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(packed) + 1), packed, label="packed")
    if padded:
        ax.plot(range(1, len(padded) + 1), padded, "--", label="padded")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over target tokens)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_pack_fill(path: Path, fills: Sequence[float], capacity: int) -> Path:
    """Histogram of real tokens per pack as a fraction of ``capacity``."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist([100 * f for f in fills], bins=20, range=(0, 100))
    ax.set_xlabel(f"pack fill (% of {capacity} tokens)")
    ax.set_ylabel("packs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
