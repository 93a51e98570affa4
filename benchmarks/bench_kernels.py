"""Boundary cost and adapter overhead of every backend of every op, forward + backward.

    python benchmarks/bench_kernels.py [--device cuda] [--dtype bfloat16] [--tokens 32768] [--repeats 20]

Per op and backend: one document of T tokens against a mixed packed row and a row of documents under
64 tokens (boundary cost, target <= 5%: ``hybrid_pack.bench.kernels``, also ``hybrid-pack bench``), and the
public op against the library's kernel called directly on the mixed row, with every boundary argument
precomputed, as an expert would call it (adapter overhead, target <= 2%: :func:`direct_call`, here). Writes
benchmarks/results/kernels_<device>.json with the device and every version, and prints markdown tables for
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from hybrid_pack.bench.kernels import (
    KernelBenchmark,
    benchmark_case,
    row_layouts,
    run_kernel_benchmarks,
    time_forward_backward,
)
from hybrid_pack.bench.report import kernel_table
from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.attention import kernel_flex, kernel_torch_varlen
from hybrid_pack.ops.conv import kernel_fla as conv_fla
from hybrid_pack.ops.dispatch.backend import Backend
from hybrid_pack.ops.dispatch.registry import get_backend
from hybrid_pack.ops.gated_delta import kernel_fla as gated_delta_fla
from hybrid_pack.ops.selfcheck.contract import CheckCase
from hybrid_pack.ops.selfcheck.kept import environment
from hybrid_pack.ops.selfcheck.result import device_name

RESULTS = Path(__file__).parent / "results"


@dataclass
class AdapterOverhead:
    """One backend's public op (its :class:`KernelBenchmark`'s mixed row) against its kernel called directly."""

    op: str
    backend: str
    dtype: str
    public_op_ms: float
    direct_kernel_ms: float = float("nan")
    direct_kernel_failed: str = ""  # why the direct call could not be timed (the public op's times still stand)

    @property
    def adapter_overhead(self) -> float:
        """The public op over the kernel called directly, on the mixed row, minus one."""
        return self.public_op_ms / self.direct_kernel_ms - 1

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "adapter_overhead": self.adapter_overhead}


def direct_call(backend: Backend, case: CheckCase, boundaries: PackedBoundaries) -> Callable[[], Any]:
    """The library kernel behind ``backend`` called directly, with every boundary argument precomputed.

    Raises:
        LookupError: no direct call is known for this backend (a user's own, for one).
    """
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
        from torch.nn.attention.flex_attention import flex_attention

        pad = kernel_flex.bucket_length(boundaries.total_tokens) - boundaries.total_tokens
        padded = [torch.nn.functional.pad(a[k].detach(), (0, 0, 0, 0, 0, pad)).transpose(1, 2).requires_grad_()
                  for k in ("q", "k", "v")]
        mask = kernel_flex.document_block_mask(boundaries, a["causal"])
        attend = torch.compile(flex_attention, dynamic=False) if boundaries.device.type == "cuda" else flex_attention
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


def adapter_overhead(result: KernelBenchmark, device: torch.device, dtype: torch.dtype, repeats: int
                     ) -> AdapterOverhead:
    """``result``'s public op on the mixed row against :func:`direct_call` on the same inputs."""
    overhead = AdapterOverhead(result.op, result.backend, result.dtype, result.mixed_ms)
    case, boundaries = benchmark_case(result.op, dtype, row_layouts(result.op, dtype, device, result.tokens)["mixed"],
                                      device)
    try:
        overhead.direct_kernel_ms = time_forward_backward(
            direct_call(get_backend(result.op, result.backend), case, boundaries), device, repeats=repeats)
    except (LookupError, RuntimeError, ValueError, TypeError) as err:  # the public op's times still stand
        overhead.direct_kernel_failed = f"{type(err).__name__}: {err}"
    return overhead


def overhead_table(overheads: list[AdapterOverhead]) -> str:
    """One row per backend timed: the public op and the direct call on the mixed row, and the adapter overhead."""
    lines = ["| op | backend | dtype | public op ms | kernel direct ms | adapter overhead |",
             "|---|---|---|---:|---:|---:|"]
    for o in overheads:
        direct = (f"failed: {o.direct_kernel_failed} | " if o.direct_kernel_failed
                  else f"{o.direct_kernel_ms:.3f} | {o.adapter_overhead:+.1%}")
        lines.append(f"| {o.op} | `{o.backend}` | {o.dtype} | {o.public_op_ms:.3f} | {direct} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per row (default: 32768 on CUDA, 8192 on CPU)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokens = args.tokens or (32_768 if device.type == "cuda" else 8192)
    results = run_kernel_benchmarks(device, dtype, tokens, args.repeats)
    overheads = [adapter_overhead(r, device, dtype, args.repeats) for r in results if not r.skipped]
    out = RESULTS / f"kernels_{device.type}.json"
    out.write_text(json.dumps({"device": device_name(device), "environment": environment(), "tokens": tokens,
                               "results": [r.to_dict() for r in results],
                               "adapter_overhead": [o.to_dict() for o in overheads]}, indent=1))
    print(kernel_table(results), overhead_table(overheads), sep="\n\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
