"""Kernel benchmarks: what document boundaries cost each backend.

For every op and every backend that passes its self-check on the device, forward + backward of the
public op (``backend=`` forced) is timed on three rows of the same ``T`` tokens (:func:`row_layouts`): one
document (the baseline), a mixed row (:func:`~hybrid_pack.isolation.real_size_layout`) and a row of documents
under 64 tokens. *Boundary cost* is the packed row's time over the one-document row's, minus one
(target: at most 5%); not for attention, whose work is quadratic in each document's length (one document of
``T`` tokens is far more work than the packed rows: the figure would be negative whatever the boundaries cost).
The ops without a benchmark here (:func:`not_benchmarked`) are listed as such. The op's typical signature on the
device is used (``OpContract.default_signature``).
What the adapter costs over the library's own kernel is measured beside the package, in
``benchmarks/bench_kernels.py``, on the same mixed row (:func:`benchmark_case`).

Times are medians of ``repeats`` runs after warm-up runs: CUDA events on CUDA, wall time elsewhere.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import BackendUnavailableError
from hybrid_pack.isolation import Layout, one_document_layout, real_size_layout, short_document_layout
from hybrid_pack.ops import causal_conv1d, gated_delta_rule, mamba2_ssd, varlen_attention
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import backends_of, contract_of, registered_ops
from hybrid_pack.ops.dispatch.selector import resolve
from hybrid_pack.ops.selfcheck.contract import CheckCase, dtype_name, signature_text

__all__ = ["KernelBenchmark", "benchmark_backend", "benchmark_case", "not_benchmarked", "row_layouts",
           "run_kernel_benchmarks", "time_forward_backward"]

PUBLIC_OPS: dict[str, Callable[..., Any]] = {"attention": varlen_attention, "conv": causal_conv1d,
                                             "gated_delta": gated_delta_rule, "ssd": mamba2_ssd}
QUADRATIC = frozenset({"attention"})
"""Ops whose work per document grows faster than its length: no boundary cost against one document."""


@dataclass
class KernelBenchmark:
    """One backend of one op: milliseconds of forward + backward of the public op per row layout, and the
    boundary costs derived from them."""

    op: str
    backend: str
    dtype: str
    signature: str
    tokens: int
    one_document_ms: float = float("nan")
    mixed_ms: float = float("nan")
    mixed_documents: int = 0
    short_documents_ms: float = float("nan")
    short_documents: int = 0
    skipped: str = ""

    @property
    def boundary_cost(self) -> float:
        """Mixed row over one document, minus one (NaN for :data:`QUADRATIC` ops: not the same work)."""
        return float("nan") if self.op in QUADRATIC else self.mixed_ms / self.one_document_ms - 1

    @property
    def short_boundary_cost(self) -> float:
        """Row of documents under 64 tokens over one document, minus one (NaN for :data:`QUADRATIC` ops)."""
        return float("nan") if self.op in QUADRATIC else self.short_documents_ms / self.one_document_ms - 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "boundary_cost": self.boundary_cost, "short_boundary_cost": self.short_boundary_cost}


def time_forward_backward(fn: Callable[[], Any], device: torch.device, *, repeats: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of ``fn()`` and the backward pass of the sum of its (first) output."""

    def once() -> None:
        out = fn()
        first = out[0] if isinstance(out, tuple) else out
        first.float().sum().backward()

    for _ in range(warmup):
        once()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            once()
            times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def row_layouts(op: str, dtype: torch.dtype, device: torch.device, tokens: int) -> dict[str, Layout]:
    """The three rows of ``tokens`` tokens each backend of ``op`` is timed on: ``one_document``, ``mixed`` (its
    documents end on the kernel's block edges of the op's typical signature) and ``short_documents``."""
    contract = contract_of(op)
    edge = contract.edge(contract.default_signature(dtype, device.type))
    return {"one_document": one_document_layout(tokens), "mixed": real_size_layout(edge, tokens),
            "short_documents": short_document_layout(tokens)}


def benchmark_case(op: str, dtype: torch.dtype, layout: Layout, device: torch.device
                   ) -> tuple[CheckCase, PackedBoundaries]:
    """Inputs of ``op``'s typical signature on the ``layout`` row (the same for every call: seeded), the floating
    ones requiring grad, and the row's boundaries on ``device``."""
    contract = contract_of(op)
    boundaries = layout.boundaries(device)
    case = contract.make_case(contract.default_signature(dtype, device.type), boundaries,
                              torch.Generator().manual_seed(0))
    arguments = {name: value.requires_grad_() if isinstance(value, torch.Tensor) and value.is_floating_point()
                 else value for name, value in case.arguments.items()}
    return CheckCase(arguments, case.positional, case.token_inputs, case.document_inputs), boundaries


def benchmark_backend(backend: Backend, dtype: torch.dtype, device: torch.device, tokens: int, repeats: int
                      ) -> KernelBenchmark:
    """The public op forced to ``backend`` on each of :func:`row_layouts`' rows (skipped, with the reason, when it
    cannot run here or fails at this size)."""
    op, contract = backend.op, contract_of(backend.op)
    signature = contract.default_signature(dtype, device.type)
    result = KernelBenchmark(op, backend.name, dtype_name(dtype), signature_text(signature), tokens)
    try:
        resolve(op, device=device, dtype=dtype, requires_grad=True, backend=backend.name, signature=signature)
    except BackendUnavailableError as err:
        result.skipped = str(err)
        return result
    public = PUBLIC_OPS[op]
    for name, layout in row_layouts(op, dtype, device, tokens).items():
        case, boundaries = benchmark_case(op, dtype, layout, device)
        call = functools.partial(case.call, public, boundaries, {**case.arguments, "backend": backend.name})
        try:  # one backend failing at this size skips only itself (the timing below is not the backend's)
            call()
        except (RuntimeError, ValueError, TypeError) as err:
            result.skipped = f"{name} row failed: {type(err).__name__}: {err}"
            return result
        milliseconds = time_forward_backward(call, device, repeats=repeats)
        setattr(result, f"{name}_ms", milliseconds)
        if name == "mixed":
            result.mixed_documents = len(layout.lengths)
        if name == "short_documents":
            result.short_documents = len(layout.lengths)
    return result


def run_kernel_benchmarks(device: torch.device | str, dtype: torch.dtype, tokens: int, repeats: int = 20, *,
                          progress: bool | None = None) -> list[KernelBenchmark]:
    """Every backend of every op on ``device`` (those that cannot run, or fail their check, are listed skipped);
    ``progress``: a progress bar, one step per backend (default: when stderr is a terminal)."""
    device = torch.device(device)
    chosen = [backend for op in registered_ops() if op in PUBLIC_OPS for backend in backends_of(op)
              if not backend.reason(device, dtype, True) or not backend.reference]
    results = []
    with tqdm(chosen, desc="kernel benchmarks", unit="backend", disable=None if progress is None else not progress
              ) as bar:
        for backend in bar:
            bar.set_postfix_str(f"{backend.op} {backend.name}")
            results.append(benchmark_backend(backend, dtype, device, tokens, repeats))
    return results


def not_benchmarked() -> list[str]:
    """The registered ops without a kernel benchmark here (their backends are checked, not timed)."""
    return [op for op in registered_ops() if op not in PUBLIC_OPS]
