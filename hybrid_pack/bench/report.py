"""Benchmark results as the markdown tables of docs/benchmarks.md."""

from __future__ import annotations

from hybrid_pack.bench.kernels import KernelBenchmark

__all__ = ["kernel_table"]


def kernel_table(results: list[KernelBenchmark]) -> str:
    """One row per backend: milliseconds per layout, boundary costs and adapter overhead (skipped ones say why)."""
    lines = ["| op | backend | dtype | one doc ms | mixed ms (docs) | boundary cost | docs < 64 ms (docs) "
             "| boundary cost | kernel direct ms | adapter overhead |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.op} | `{r.backend}` | {r.dtype} | skipped: {r.skipped.split(': ', 1)[-1]} "
                         "| | | | | | |")
            continue
        direct = (f"failed: {r.direct_kernel_failed} | " if r.direct_kernel_failed
                  else f"{r.direct_kernel_ms:.3f} | {r.adapter_overhead:+.1%}")
        lines.append(f"| {r.op} | `{r.backend}` | {r.dtype} | {r.one_document_ms:.3f} | {r.mixed_ms:.3f} "
                     f"({r.mixed_documents}) | {r.boundary_cost:+.1%} | {r.short_documents_ms:.3f} "
                     f"({r.short_documents}) | {r.short_boundary_cost:+.1%} | {direct} |")
    return "\n".join(lines)
