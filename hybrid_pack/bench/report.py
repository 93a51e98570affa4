"""Benchmark results as the markdown tables of docs/benchmarks.md."""

from __future__ import annotations

from hybrid_pack.bench.kernels import KernelBenchmark

__all__ = ["kernel_table"]


def kernel_table(results: list[KernelBenchmark]) -> str:
    """One row per backend: milliseconds per layout and the boundary costs (skipped ones say why)."""
    lines = ["| op | backend | dtype | one doc ms | mixed ms (docs) | boundary cost | docs < 64 ms (docs) "
             "| boundary cost |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.op} | `{r.backend}` | {r.dtype} | skipped: {r.skipped.split(': ', 1)[-1]} | | | | |")
            continue
        cost, short = (("n/a (quadratic)",) * 2 if r.boundary_cost != r.boundary_cost
                       else (f"{r.boundary_cost:+.1%}", f"{r.short_boundary_cost:+.1%}"))
        lines.append(f"| {r.op} | `{r.backend}` | {r.dtype} | {r.one_document_ms:.3f} | {r.mixed_ms:.3f} "
                     f"({r.mixed_documents}) | {cost} | {r.short_documents_ms:.3f} ({r.short_documents}) | {short} |")
    return "\n".join(lines)
