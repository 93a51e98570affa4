"""Chunked pure-torch Mamba-2 SSD vs the per-token reference: forward + backward on a packed row.

    .venv/bin/python benchmarks/bench_ssd.py            # T=4096, 8 documents, H=4, P=64, N=64, G=1, fp32

The call is a full Mamba-2 one (dt_bias + softplus, D [H], z gate), on one intra-op thread by
default (``--threads``). Writes ``benchmarks/results/ssd.json`` and prints a markdown table for
docs/benchmarks.md. Each timing is the best of ``--repeats`` runs (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops import mamba2_ssd
from tests.ops.reference.ssd import mamba2_ssd_reference

RESULTS = Path(__file__).resolve().parent / "results" / "ssd.json"


def document_lengths(total: int, num_docs: int, rng: np.random.Generator) -> list[int]:
    """``num_docs`` positive lengths summing to ``total``, cut at distinct random points."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=num_docs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).tolist()


def make_inputs(tokens: int, heads: int, head_dim: int, groups: int, state_dim: int,
                seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(1, tokens, heads, head_dim, generator=gen),
        "dt": torch.randn(1, tokens, heads, generator=gen),
        "A": -torch.empty(heads).uniform_(1.0, 16.0, generator=gen),
        "B": torch.randn(1, tokens, groups, state_dim, generator=gen),
        "C": torch.randn(1, tokens, groups, state_dim, generator=gen),
        "D": torch.ones(heads),
        "z": torch.randn(1, tokens, heads, head_dim, generator=gen),
        "dt_bias": torch.randn(heads, generator=gen) - 4.0,
    }


def time_fwd_bwd(fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor], repeats: int) -> float:
    """Best wall time (s) of forward + backward of ``sum(y * weight)`` with every input a leaf."""
    weight = torch.randn_like(inputs["x"])
    best = float("inf")
    for _ in range(repeats):
        leaves = {name: t.detach().requires_grad_() for name, t in inputs.items()}
        start = time.perf_counter()
        (fn(**leaves) * weight).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64, help="P")
    parser.add_argument("--state-dim", type=int, default=64, help="N")
    parser.add_argument("--groups", type=int, default=1, help="G (B/C groups)")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads; 1 keeps timings stable on a shared machine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    lengths = document_lengths(args.tokens, args.docs, np.random.default_rng(args.seed))
    boundaries = PackedBoundaries.from_lengths(lengths)
    inputs = make_inputs(args.tokens, args.heads, args.head_dim, args.groups, args.state_dim, args.seed)

    def chunked(chunk_size: int) -> Callable[..., torch.Tensor]:
        def run(**kw: torch.Tensor) -> torch.Tensor:
            return mamba2_ssd(**kw, boundaries=boundaries, chunk_size=chunk_size, backend="torch")
        return run

    def reference(**kw: torch.Tensor) -> torch.Tensor:
        return mamba2_ssd_reference(**kw, boundaries=boundaries)[0]

    chunk_times = {c: time_fwd_bwd(chunked(c), inputs, args.repeats) for c in args.chunk_sizes}
    ref_time = time_fwd_bwd(reference, inputs, args.reference_repeats)

    rows = [("reference (per-token loop, autograd)", ref_time)]
    rows += [(f"mamba2_ssd(backend='torch', chunk_size={c})", s) for c, s in chunk_times.items()]
    result = {
        "benchmark": "mamba2_ssd forward+backward, CPU float32",
        "command": " ".join(["python benchmarks/bench_ssd.py", *sys.argv[1:]]),
        "tokens": args.tokens, "lengths": lengths, "heads": args.heads, "head_dim": args.head_dim,
        "state_dim": args.state_dim, "groups": args.groups, "threads": args.threads, "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "reference_seconds": ref_time,
        "chunked_seconds": {str(c): s for c, s in chunk_times.items()},
        "tokens_per_second": {"reference": args.tokens / ref_time,
                              **{str(c): args.tokens / s for c, s in chunk_times.items()}},
        "speedup_vs_reference": {str(c): ref_time / s for c, s in chunk_times.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"T={args.tokens} ({args.docs} documents, max {max(lengths)}), H={args.heads}, P={args.head_dim}, "
          f"N={args.state_dim}, G={args.groups}, float32, {args.threads} threads, best of {args.repeats} "
          f"(reference: best of {args.reference_repeats})")
    print("| implementation | fwd+bwd (s) | tokens/s | speedup vs reference |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.3f} | {args.tokens / seconds:,.0f} | {ref_time / seconds:.1f}x |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
