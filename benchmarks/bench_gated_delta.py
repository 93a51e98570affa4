"""Chunked pure-torch gated delta rule vs the per-token reference: forward + backward on a packed row.

    .venv/bin/python benchmarks/bench_gated_delta.py            # T=4096, 8 documents, H=4, K=V=64, fp32

On a machine shared with other jobs, run with ``OMP_WAIT_POLICY=PASSIVE``: spinning OpenMP threads
that wait for a busy core otherwise dominate every multi-threaded figure.

Writes ``benchmarks/results/gated_delta.json`` and prints a markdown table for docs/benchmarks.md.
Each figure is the best of ``--repeats`` round-robin runs. Wall time and process CPU time are both
recorded: on a shared machine the wall time includes waiting for a core, the CPU time does not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_pack import PackedBoundaries
from hybrid_pack.ops import gated_delta_rule
from hybrid_pack.ops.gated_delta import torch_backend
from tests.ops.reference.gated_delta import gated_delta_rule_reference

RESULTS = Path(__file__).resolve().parent / "results" / "gated_delta.json"

GatedDelta = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def random_lengths(total: int, num_docs: int, rng: np.random.Generator) -> list[int]:
    """``num_docs`` positive lengths summing to ``total`` (uniform random cut points)."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=num_docs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).tolist()


def make_inputs(lengths: list[int], heads: int, dim: int, seed: int) -> dict[str, torch.Tensor]:
    """float32 q, k (unit norm), v ``[1, T, H, dim]``; g = -softplus(randn), beta = sigmoid(randn) ``[1, T, H]``."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return {
        "q": torch.randn(1, t, heads, dim, generator=gen),
        "k": F.normalize(torch.randn(1, t, heads, dim, generator=gen), dim=-1),
        "v": torch.randn(1, t, heads, dim, generator=gen),
        "g": -F.softplus(torch.randn(1, t, heads, generator=gen)),
        "beta": torch.randn(1, t, heads, generator=gen).sigmoid(),
    }


def time_fwd_bwd(fn: GatedDelta, inputs: dict[str, torch.Tensor], boundaries: PackedBoundaries,
                 weight: torch.Tensor) -> tuple[float, float]:
    """(wall, process CPU) seconds of one forward + backward of ``sum(o * weight)``."""
    leaves = {name: x.detach().requires_grad_() for name, x in inputs.items()}
    wall, cpu = time.perf_counter(), time.process_time()
    o, _ = fn(**leaves, boundaries=boundaries)
    (o * weight).sum().backward()
    return time.perf_counter() - wall, time.process_time() - cpu


def chunked(chunk_size: int, scale: float) -> GatedDelta:
    """The torch backend at a given chunk size (the public op always uses ``CHUNK_SIZE``)."""
    def run(**inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return torch_backend.gated_delta_rule(**inputs, scale=scale, initial_state=None, output_final_state=False,
                                              use_qk_l2norm=False, chunk_size=chunk_size)
    return run


def public_op(**inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    return gated_delta_rule(**inputs, backend="torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64, help="K = V")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    lengths = random_lengths(args.tokens, args.docs, np.random.default_rng(args.seed))
    boundaries = PackedBoundaries.from_lengths(lengths)
    inputs = make_inputs(lengths, args.heads, args.dim, args.seed)
    weight = torch.randn_like(inputs["v"])
    candidates = {"reference": gated_delta_rule_reference, "public_op": public_op,
                  **{f"chunk_{c}": chunked(c, args.dim ** -0.5) for c in args.chunk_sizes}}
    labels = {"reference": "per-token reference (tests/ops/reference)",
              "public_op": f"ops.gated_delta_rule(backend='torch'), C={torch_backend.CHUNK_SIZE}",
              **{f"chunk_{c}": f"torch backend, C={c}" for c in args.chunk_sizes}}

    runs: dict[int, dict[str, dict[str, float]]] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in candidates}
        # Round-robin, so a burst of load from other processes hits every candidate alike.
        for round_ in range(args.repeats):
            for name, fn in candidates.items():
                if name != "reference" or round_ < args.reference_repeats:
                    times[name].append(time_fwd_bwd(fn, inputs, boundaries, weight))
        runs[threads] = {name: {"wall_s": min(w for w, _ in t), "cpu_s": min(c for _, c in t)}
                         for name, t in times.items()}

    result = {
        "benchmark": "gated_delta_rule forward+backward, CPU float32",
        "command": " ".join(["python", "benchmarks/bench_gated_delta.py", *sys.argv[1:]]),
        "tokens": args.tokens, "lengths": lengths, "heads": args.heads, "k_dim": args.dim, "v_dim": args.dim,
        "default_chunk_size": torch_backend.CHUNK_SIZE, "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"), "repeats": args.repeats,
        "by_threads": {
            str(threads): {
                name: {**r, "tokens_per_s": args.tokens / r["wall_s"],
                       "speedup_wall": runs[threads]["reference"]["wall_s"] / r["wall_s"],
                       "speedup_cpu": runs[threads]["reference"]["cpu_s"] / r["cpu_s"]}
                for name, r in runs[threads].items()}
            for threads in args.threads},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"T={args.tokens} ({args.docs} documents, longest {max(lengths)}), H={args.heads}, K=V={args.dim}, "
          f"float32, forward+backward, best of {args.repeats} (reference: {args.reference_repeats})")
    print("| implementation | threads | wall s | CPU s | tokens/s | speedup (wall) | speedup (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for threads, table in result["by_threads"].items():
        for name, r in table.items():
            print(f"| {labels[name]} | {threads} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['tokens_per_s']:,.0f} "
                  f"| {r['speedup_wall']:.1f}x | {r['speedup_cpu']:.1f}x |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
