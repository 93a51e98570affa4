"""Kernel benchmarks: what document boundaries cost each backend, and what the adapter costs over its kernel.

For every op and every backend that passes its self-check on the device, forward + backward of the
public op (``backend=`` forced) is timed on three rows of the same ``T`` tokens: one document (the
baseline), a mixed row (:func:`~hybrid_pack.bench.layouts.real_size_layout`) and a row of documents
under 64 tokens. *Boundary cost* is the packed row's time over the one-document row's, minus one
(target: at most 5%). The same mixed row is also timed through the library's kernel called directly
with precomputed arguments, as an expert would call it; *adapter overhead* is the public op's time
over that, minus one (target: at most 2%). The op's typical signature on the device is used
(``OpContract.default_signature``).

Times are medians of ``repeats`` runs after warm-up runs: CUDA events on CUDA, wall time elsewhere.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hybrid_pack.bench.layouts import one_document_layout, real_size_layout, short_document_layout
from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.errors import BackendUnavailableError
from hybrid_pack.ops import causal_conv1d, gated_delta_rule, mamba2_ssd, varlen_attention
from hybrid_pack.ops.attention import kernel_flex, kernel_torch_varlen
from hybrid_pack.ops.conv import kernel_fla as conv_fla
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.contract import CheckCase, dtype_name, signature_text
from hybrid_pack.ops.dispatch.registry import backends_of, contract_of, registered_ops
from hybrid_pack.ops.dispatch.selector import resolve
from hybrid_pack.ops.gated_delta import kernel_fla as gated_delta_fla

__all__ = ["KernelBenchmark", "benchmark_backend", "run_kernel_benchmarks", "time_forward_backward"]

PUBLIC_OPS: dict[str, Callable[..., Any]] = {"attention": varlen_attention, "conv": causal_conv1d,
                                             "gated_delta": gated_delta_rule, "ssd": mamba2_ssd}


@dataclass
class KernelBenchmark:
    """One backend of one op: milliseconds of forward + backward per row layout, and the derived costs."""

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
    direct_kernel_ms: float = float("nan")
    direct_kernel_failed: str = ""  # why the direct call could not be timed (the public op's times still stand)
    skipped: str = ""

    @property
    def boundary_cost(self) -> float:
        """Mixed row over one document, minus one."""
        return self.mixed_ms / self.one_document_ms - 1

    @property
    def short_boundary_cost(self) -> float:
        """Row of documents under 64 tokens over one document, minus one."""
        return self.short_documents_ms / self.one_document_ms - 1

    @property
    def adapter_overhead(self) -> float:
        """The public op over the kernel called directly, on the mixed row, minus one."""
        return self.mixed_ms / self.direct_kernel_ms - 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "boundary_cost": self.boundary_cost, "short_boundary_cost": self.short_boundary_cost,
                "adapter_overhead": self.adapter_overhead}


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


def _case(op: str, dtype: torch.dtype, layout: tuple[list[int], int], device: torch.device
          ) -> tuple[CheckCase, PackedBoundaries]:
    contract = contract_of(op)
    documents, padding = layout
    boundaries = PackedBoundaries.from_document_lengths(documents, num_pad_tokens=padding, device=device)
    case = contract.make_case(contract.default_signature(dtype, device.type), boundaries,
                              torch.Generator().manual_seed(0))
    arguments = {name: value.requires_grad_() if isinstance(value, torch.Tensor) and value.is_floating_point()
                 else value for name, value in case.arguments.items()}
    return CheckCase(arguments, case.positional, case.token_inputs, case.document_inputs), boundaries


def direct_kernel(backend: Backend, case: CheckCase, boundaries: PackedBoundaries) -> Callable[[], Any]:
    """The library kernel behind ``backend`` called directly, with every boundary argument precomputed."""
    a = case.arguments
    name = (backend.op, backend.name)
    if backend.reference:
        return lambda: case.call(backend.fn, boundaries)
    if name == ("attention", "flash_attn"):
        from flash_attn import flash_attn_varlen_func

        cu, longest = boundaries.cu_seqlens, boundaries.max_seqlen
        return lambda: flash_attn_varlen_func(a["q"][0], a["k"][0], a["v"][0], cu, cu, longest, longest,
                                              softmax_scale=a["softmax_scale"], causal=a["causal"])
    if name == ("attention", "torch_varlen"):
        from torch.nn.attention.varlen import varlen_attn

        cu, longest = boundaries.cu_seqlens, boundaries.max_seqlen
        q, k, v = a["q"][0], a["k"][0], a["v"][0]
        grouped: dict[str, Any] = {}
        if q.shape[1] != k.shape[1] and kernel_torch_varlen.takes_enable_gqa(varlen_attn):
            grouped["enable_gqa"] = True
        elif q.shape[1] != k.shape[1]:  # an expert on this torch repeats the key/value heads once, up front
            k, v = (t.detach().repeat_interleave(q.shape[1] // t.shape[1], dim=1).requires_grad_() for t in (k, v))
        window = kernel_torch_varlen.CAUSAL_WINDOW if a["causal"] else kernel_torch_varlen.FULL_WINDOW
        return lambda: varlen_attn(q, k, v, cu, cu, longest, longest, scale=a["softmax_scale"], window_size=window,
                                   **grouped)
    if name == ("attention", "flex"):
        pad = kernel_flex.bucket_length(boundaries.total_tokens) - boundaries.total_tokens
        padded = [torch.nn.functional.pad(a[k].detach(), (0, 0, 0, 0, 0, pad)).transpose(1, 2).requires_grad_()
                  for k in ("q", "k", "v")]
        mask = kernel_flex.document_block_mask(boundaries, a["causal"])
        attend = kernel_flex._attend(boundaries.device)
        return lambda: attend(*padded, block_mask=mask, scale=a["softmax_scale"], enable_gqa=True)
    if name == ("conv", "causal_conv1d"):
        from causal_conv1d import causal_conv1d_fn

        return lambda: causal_conv1d_fn(a["x"].transpose(1, 2), a["weight"], a["bias"], seq_idx=boundaries.seq_idx,
                                        activation=a["activation"])
    if name == ("conv", "fla"):
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv

        index, cu_cpu = boundaries.kernel_chunk_index(conv_fla.KERNEL_CHUNK_SIZE)
        return lambda: fla_conv(a["x"], a["weight"], a["bias"], activation=a["activation"], backend="triton",
                                cu_seqlens=boundaries.cu_seqlens, cu_seqlens_cpu=cu_cpu, chunk_indices=index)
    if name == ("gated_delta", "fla"):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        index, cu_cpu = boundaries.kernel_chunk_index(gated_delta_fla.KERNEL_CHUNK_SIZE)
        return lambda: chunk_gated_delta_rule(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=a["scale"],
                                              use_qk_l2norm_in_kernel=a["use_qk_l2norm"],
                                              cu_seqlens=boundaries.cu_seqlens, cu_seqlens_cpu=cu_cpu,
                                              chunk_indices=index)
    if name == ("ssd", "mamba_ssm"):
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        return lambda: mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], a["chunk_size"], D=a["D"],
                                                 z=a["z"], dt_bias=a["dt_bias"], seq_idx=boundaries.seq_idx,
                                                 dt_softplus=a["dt_softplus"])
    raise LookupError(f"no direct call known for backend {backend.op}/{backend.name}")


def benchmark_backend(backend: Backend, dtype: torch.dtype, device: torch.device, tokens: int, repeats: int
               ) -> KernelBenchmark:
    op, contract = backend.op, contract_of(backend.op)
    signature = contract.default_signature(dtype, device.type)
    result = KernelBenchmark(op, backend.name, dtype_name(dtype), signature_text(signature), tokens)
    try:
        resolve(op, device=device, dtype=dtype, requires_grad=True, backend=backend.name, signature=signature)
    except BackendUnavailableError as err:
        result.skipped = str(err)
        return result
    public = PUBLIC_OPS[op]
    layouts = {"one_document": one_document_layout(tokens), "mixed": real_size_layout(contract.edge(signature), tokens),
               "short_documents": short_document_layout(tokens)}
    for name, layout in layouts.items():
        case, boundaries = _case(op, dtype, layout, device)
        try:
            milliseconds = time_forward_backward(
                lambda case=case, boundaries=boundaries: case.call(public, boundaries, {**case.arguments,
                                                                                         "backend": backend.name}),
                device, repeats=repeats)
        except (RuntimeError, ValueError, TypeError) as err:  # one backend failing at this size skips only itself
            result.skipped = f"{name} row failed: {type(err).__name__}: {err}"
            return result
        setattr(result, f"{name}_ms", milliseconds)
        if name == "mixed":
            result.mixed_documents = len(layout[0])
            try:
                result.direct_kernel_ms = time_forward_backward(direct_kernel(backend, case, boundaries), device,
                                                                repeats=repeats)
            except (LookupError, RuntimeError, ValueError, TypeError) as err:  # the public op's times still stand
                result.direct_kernel_failed = f"{type(err).__name__}: {err}"
        if name == "short_documents":
            result.short_documents = len(layout[0])
    return result


def run_kernel_benchmarks(device: torch.device | str, dtype: torch.dtype, tokens: int, repeats: int = 20
                          ) -> list[KernelBenchmark]:
    """Every backend of every op on ``device`` (those that cannot run, or fail their check, are listed skipped)."""
    device = torch.device(device)
    return [benchmark_backend(backend, dtype, device, tokens, repeats)
            for op in registered_ops() for backend in backends_of(op)
            if not backend.reason(device, dtype, True) or not backend.reference]
