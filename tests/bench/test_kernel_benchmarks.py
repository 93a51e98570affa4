"""The kernel benchmark on CPU: a backend that fails at benchmark size, or has no known direct call
(benchmarks/bench_kernels.py's adapter overhead), is reported as such while every other backend's figures stand."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from benchmarks.bench_kernels import adapter_overhead, overhead_table
from hybrid_pack import backends
from hybrid_pack.bench.kernels import KernelBenchmark, benchmark_backend, not_benchmarked
from hybrid_pack.bench.report import kernel_table
from hybrid_pack.ops.dispatch import registry, selector
from hybrid_pack.ops.dispatch.registry import get_backend, reference_of
from hybrid_pack.ops.selfcheck import kept

TOKENS = 8192  # the smallest row the benchmark layouts take


@pytest.fixture(autouse=True)
def user_backends(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(kept.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(kept, "_memory", {})
    monkeypatch.setattr(kept, "_loaded_from", None)
    monkeypatch.setattr(selector, "_logged", set())
    yield
    kept._environment_digest.cache_clear()
    for name in ("user_conv", "big_rows_fail"):
        if any(b.name == name for b in registry.backends_of("conv")):
            registry.unregister("conv", name)


def register_conv(name: str, fails_above: int | None = None) -> None:
    reference = reference_of("conv").fn

    def conv(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if fails_above is not None and x.shape[1] > fails_above:
            raise RuntimeError(f"{name}: rows over {fails_above} tokens are not supported")
        return reference(x, *args, **kwargs)

    conv.__name__ = conv.__qualname__ = name
    backends.register("conv", name, conv, priority=100, devices=("cpu",), dtypes=(torch.float32,))


def test_a_backend_without_a_known_direct_call_keeps_its_public_op_times() -> None:
    register_conv("user_conv")
    result = benchmark_backend(get_backend("conv", "user_conv"), torch.float32, torch.device("cpu"), TOKENS,
                               repeats=1)
    assert not result.skipped
    assert all(ms > 0 for ms in (result.one_document_ms, result.mixed_ms, result.short_documents_ms))
    assert result.mixed_documents > 10 and result.short_documents > 100
    assert f"{result.mixed_ms:.3f} ({result.mixed_documents})" in kernel_table([result]).splitlines()[-1]
    overhead = adapter_overhead(result, torch.device("cpu"), torch.float32, repeats=1)
    assert "no direct call known for backend conv/user_conv" in overhead.direct_kernel_failed
    row = overhead_table([overhead]).splitlines()[-1]
    assert "failed: LookupError" in row and f"{result.mixed_ms:.3f}" in row


def test_a_backend_failing_at_benchmark_size_is_skipped_with_its_error() -> None:
    register_conv("big_rows_fail", fails_above=4096)  # passes its self-check on a small row
    result = benchmark_backend(get_backend("conv", "big_rows_fail"), torch.float32, torch.device("cpu"), TOKENS,
                               repeats=1)
    assert result.skipped.startswith("one_document row failed: RuntimeError")
    assert "rows over 4096 tokens" in result.skipped
    assert "skipped: " in kernel_table([result])


def test_the_reference_backend_is_timed_directly_too() -> None:
    result = benchmark_backend(reference_of("conv"), torch.float32, torch.device("cpu"), TOKENS, repeats=1)
    overhead = adapter_overhead(result, torch.device("cpu"), torch.float32, repeats=1)
    assert not result.skipped and not overhead.direct_kernel_failed
    assert overhead.direct_kernel_ms > 0 and overhead.public_op_ms == result.mixed_ms
    assert f"{overhead.adapter_overhead:+.1%}" in overhead_table([overhead])


def test_attention_has_no_boundary_cost_against_one_document() -> None:
    """One causal document of T tokens is quadratic work, far more than the packed rows': attention's "boundary
    cost" came out -67% and -94%, meeting its target whatever the boundaries cost."""
    attention = KernelBenchmark("attention", "torch", "float32", "", TOKENS, one_document_ms=10.0, mixed_ms=3.0,
                                mixed_documents=120, short_documents_ms=1.0, short_documents=1500)
    conv = KernelBenchmark("conv", "torch", "float32", "", TOKENS, one_document_ms=10.0, mixed_ms=10.5,
                           mixed_documents=120, short_documents_ms=11.0, short_documents=1500)
    assert math.isnan(attention.boundary_cost) and math.isnan(attention.short_boundary_cost)
    assert conv.boundary_cost == pytest.approx(0.05)
    table = kernel_table([attention, conv]).splitlines()
    assert table[-2].count("n/a (quadratic)") == 2 and "+5.0%" in table[-1]
    assert sorted(not_benchmarked()) == ["decay_linear_attention", "kda", "linear_cross_entropy", "selective_scan"]


def test_an_error_of_the_timing_itself_is_not_reported_as_a_skipped_backend() -> None:
    with pytest.raises(statistics.StatisticsError):
        benchmark_backend(reference_of("conv"), torch.float32, torch.device("cpu"), TOKENS, repeats=0)
