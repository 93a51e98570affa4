"""What the isolation harness found, for a person (``str``) and for a machine (``to_dict``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DocumentResult:
    """Figures for one document of a packed layout.

    Attributes:
        index: position of the document in the row.
        length: its tokens.
        alone_diff: the relative error (:func:`hybrid_pack.isolation.relative_error`) of the document's outputs in
            the packed row against its outputs run alone; the outputs are the report's ``compared`` (logits, or the
            hidden states entering the output head); on a training step, whatever it is judged by: per-token
            log-probs or logits, or its loss.
        perturbation_leak: the relative error of *other* documents' outputs when this document's tokens change.
        gradient_leak: max |d (random weighting of this document's outputs) / d embeddings of other documents|
            (:func:`hybrid_pack.isolation.leaked_gradient`).
    """

    index: int
    length: int
    alone_diff: float = 0.0
    perturbation_leak: float | None = None
    gradient_leak: float | None = None


@dataclass
class LayoutResult:
    """The checks of one layout."""

    name: str
    lengths: list[int]
    num_pad_tokens: int
    documents: list[DocumentResult]
    first_leaking_module: str | None = None
    leak_kind: str | None = None
    ok: bool = True
    leak_rank: int | None = None
    """Under a process group (docs/api.md §7b): the rank whose batch showed the leak; ``ok`` is then False on
    every rank, while the figures stay this rank's own."""

    @property
    def max_leak(self) -> float:
        values = [v for d in self.documents for v in (d.alone_diff, d.perturbation_leak, d.gradient_leak)
                  if v is not None]
        return max(values, default=0.0)


@dataclass
class IsolationReport:
    """Outcome of :func:`~hybrid_pack.testing.check_isolation`.

    ``ok`` is true when every document of every layout matched its lone run within ``atol`` (by default the
    dtype's :data:`hybrid_pack.isolation.TOLERANCE`) and no document's tokens or gradients reached another
    document.
    """

    model: str
    dtype: str
    atol: float
    grad_atol: float
    layouts: list[LayoutResult]
    skipped: list[str] = field(default_factory=list)
    error: str | None = None
    compared: str | None = None  # what check_isolation compared: logits, or the hidden states entering the head

    @property
    def ok(self) -> bool:
        return self.error is None and all(layout.ok for layout in self.layouts)

    @property
    def max_leak(self) -> float:
        return max((layout.max_leak for layout in self.layouts), default=0.0)

    @property
    def first_leaking_module(self) -> str | None:
        return next((lay.first_leaking_module for lay in self.layouts if lay.first_leaking_module), None)

    @property
    def documents(self) -> list[DocumentResult]:
        """Per-document figures of every layout, in order."""
        return [doc for layout in self.layouts for doc in layout.documents]

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "max_leak": self.max_leak, "first_leaking_module": self.first_leaking_module,
                "model": self.model, "dtype": self.dtype, "atol": self.atol, "grad_atol": self.grad_atol,
                "compared": self.compared, "error": self.error, "skipped": self.skipped,
                "layouts": [asdict(lay) for lay in self.layouts]}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        if self.error:   # the check could not run: no verdict either way
            lines = [f"ERROR: {self.model} ({self.dtype}): the check did not complete: {self.error}"]
        else:
            verdict = "ISOLATED" if self.ok else "LEAK"
            lines = [f"{verdict}: {self.model} ({self.dtype}), max leak {self.max_leak:.3g} "
                     f"(tolerance {self.atol:.1g}, gradients {self.grad_atol:.1g})"]
        if self.compared:
            lines.append(f"  compared: {self.compared}")
        for lay in self.layouts:
            pad = f" + {lay.num_pad_tokens} padding" if lay.num_pad_tokens else ""
            found = f" (leak found on rank {lay.leak_rank})" if lay.leak_rank is not None else ""
            state = "not run" if self.error and not lay.ok else "ok" if lay.ok else "LEAK"
            lines.append(f"  [{state}] {lay.name}: lengths {lay.lengths}{pad}{found}")
            for d in lay.documents:
                flags = [f"alone {d.alone_diff:.2g}"]
                if d.perturbation_leak is not None:
                    flags.append(f"perturbation {d.perturbation_leak:.2g}")
                if d.gradient_leak is not None:
                    flags.append(f"gradient {d.gradient_leak:.2g}")
                lines.append(f"      doc {d.index} (len {d.length}): " + ", ".join(flags))
            if lay.first_leaking_module:
                lines.append(f"      first leaking module ({lay.leak_kind}): {lay.first_leaking_module}")
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)
