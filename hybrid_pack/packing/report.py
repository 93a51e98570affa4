"""What a packing plan saves: its statistics next to the padding that padded batching would spend."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from hybrid_pack.errors import InputError
from hybrid_pack.packing.plan import PackPlan

__all__ = ["PackingReport", "packing_report"]


@dataclass(frozen=True)
class PackingReport:
    """Statistics of one :class:`~hybrid_pack.PackPlan` and of the padded layouts it replaces.

    Attributes:
        strategy, overflow, capacity: how the plan was made.
        examples: examples given to the planner.
        documents: documents packed (examples kept, every piece of a split example counted).
        tokens_in: tokens of all examples given.
        tokens: real tokens kept in the packs.
        packs: rows of ``capacity`` tokens the plan uses.
        lower_bound: ``ceil(tokens / capacity)``, the fewest rows any plan could use.
        efficiency: ``tokens / (packs * capacity)``.
        packed_padding: empty slots in the packs, ``packs * capacity - tokens``.
        batch_size: rows per batch of the padded-batching comparison.
        padded_batch_padding: padding if the documents, in example order, were batched
            ``batch_size`` at a time and each batch padded to its longest document.
        padded_to_capacity_padding: padding if every document were padded to ``capacity``.
    """

    strategy: str
    overflow: str
    capacity: int
    examples: int
    documents: int
    tokens_in: int
    tokens: int
    packs: int
    lower_bound: int
    efficiency: float
    packed_padding: int
    batch_size: int
    padded_batch_padding: int
    padded_to_capacity_padding: int

    @property
    def gap(self) -> int:
        """Packs above the lower bound."""
        return self.packs - self.lower_bound

    @property
    def gap_fraction(self) -> float:
        """``gap / lower_bound`` (0.0 for an empty plan)."""
        return self.gap / self.lower_bound if self.lower_bound else 0.0

    @property
    def padded_batch_efficiency(self) -> float:
        """Real tokens over tokens computed with padded batches."""
        return self.tokens / (self.tokens + self.padded_batch_padding) if self.tokens else 0.0

    @property
    def padded_to_capacity_efficiency(self) -> float:
        """Real tokens over tokens computed when every document is padded to ``capacity``."""
        return self.tokens / (self.tokens + self.padded_to_capacity_padding) if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Every field and derived figure as plain Python numbers (JSON-ready)."""
        return {**asdict(self), "gap": self.gap, "gap_fraction": self.gap_fraction,
                "padded_batch_efficiency": self.padded_batch_efficiency,
                "padded_to_capacity_efficiency": self.padded_to_capacity_efficiency}

    def __str__(self) -> str:
        rows = [
            (f"packed ({self.strategy})", self.packs, self.packed_padding, self.efficiency),
            (f"padded batches of {self.batch_size}", -(-self.documents // self.batch_size),
             self.padded_batch_padding, self.padded_batch_efficiency),
            ("padded to capacity", self.documents, self.padded_to_capacity_padding,
             self.padded_to_capacity_efficiency),
        ]
        lines = [
            f"Packing plan: {self.examples:,} examples -> {self.documents:,} documents, "
            f"{self.tokens:,} of {self.tokens_in:,} tokens kept (overflow={self.overflow!r})",
            f"{self.packs:,} packs of {self.capacity:,} tokens; lower bound {self.lower_bound:,}, "
            f"gap {self.gap:,} ({self.gap_fraction:.3%})",
            f"{'layout':<26}{'rows':>12}{'padding':>16}{'efficiency':>12}",
        ]
        lines += [f"{name:<26}{count:>12,}{padding:>16,}{eff:>12.2%}" for name, count, padding, eff in rows]
        return "\n".join(lines)


def _padded_batch_padding(lengths: np.ndarray, batch_size: int) -> int:
    """Padding of ``lengths`` (in order) batched ``batch_size`` at a time, each batch padded to its longest."""
    if lengths.size == 0:
        return 0
    num_batches = -(-lengths.size // batch_size)
    batches = np.zeros(num_batches * batch_size, np.int64)
    batches[: lengths.size] = lengths
    longest = batches.reshape(num_batches, batch_size).max(axis=1)
    rows = np.full(num_batches, batch_size, np.int64)
    rows[-1] = lengths.size - (num_batches - 1) * batch_size
    return int((longest * rows).sum() - lengths.sum())


def packing_report(plan: PackPlan, *, batch_size: int = 8) -> PackingReport:
    """Summarise ``plan`` and compare it with padded batching of the same documents.

    Args:
        plan: the plan to describe.
        batch_size: rows per padded batch in the comparison (documents in example order).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size: expected an int >= 1; got {batch_size!r}")
    in_example_order = np.lexsort((plan.start, plan.example_index))
    lengths = plan.item_lengths[in_example_order]
    return PackingReport(
        strategy=plan.strategy,
        overflow=plan.overflow,
        capacity=plan.capacity,
        examples=plan.num_examples,
        documents=plan.num_documents,
        tokens_in=plan.tokens_in,
        tokens=plan.tokens_kept,
        packs=len(plan),
        lower_bound=plan.lower_bound,
        efficiency=plan.efficiency,
        packed_padding=len(plan) * plan.capacity - plan.tokens_kept,
        batch_size=batch_size,
        padded_batch_padding=_padded_batch_padding(lengths, batch_size),
        padded_to_capacity_padding=plan.num_documents * plan.capacity - plan.tokens_kept,
    )
