"""Per-call dispatch overhead of every op: the public op against the backend it chose, called directly.

    python benchmarks/bench_dispatch_overhead.py [--calls 2000] [--repeats 1] [--ops conv ssd ...] [--documents 3]
        [--label after] [--out benchmarks/results/dispatch_overhead.json]

Small CPU calls, no gradients. The chosen backend (the pure-torch one on a CPU) is replaced, for the whole run, by a
stub that returns its precomputed result, so both timings hold the same stub call and their difference is the
op's own Python: validation, the choice of the backend, the call's plumbing (target: <= 5 us). The op is first
called once (the single process's warm-up); then the medians of ``--calls`` single calls, interleaved, are taken.
With ``--repeats``, every op is measured that many times in turn and each figure is the median of the repeats (the
overheads of all repeats are kept, for the spread).
Also timed, for scale: the op forced to the pure-torch backend, and that backend called directly.
The row holds 3 documents (5, 7 and 4 tokens), or ``--documents`` documents of 2 tokens (what the op's Python
pays per document).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hybrid_pack.ops as ops
from hybrid_pack.boundaries import PackedBoundaries
from hybrid_pack.ops.dispatch.registry import contract_of, get_backend

RESULTS = Path(__file__).parent / "results"
PUBLIC = {"attention": ops.varlen_attention, "conv": ops.causal_conv1d, "gated_delta": ops.gated_delta_rule,
          "ssd": ops.mamba2_ssd, "kda": ops.kda, "decay_linear_attention": ops.decay_linear_attention,
          "selective_scan": ops.selective_scan, "linear_cross_entropy": ops.linear_cross_entropy}


def _calls(op: str, boundaries: PackedBoundaries, **forced: str
           ) -> tuple[Callable[[], Any], Callable[[Callable[..., Any]], Any]]:
    """``(public call, direct(fn) call)`` on one small case of ``op``'s typical CPU signature."""
    public = functools.partial(PUBLIC[op], **forced)
    contract = contract_of(op)
    case = contract.make_case(contract.default_signature(torch.float32, "cpu"), boundaries,
                              torch.Generator().manual_seed(0))
    args = case.arguments
    if op == "linear_cross_entropy":  # no boundaries; the backend gets [N, H] rows and [N] targets
        hidden, targets = args["hidden"], args["targets"]
        rows, flat = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        items = int((flat != -100).sum())  # given, as a training step does; the op divides by it
        return (lambda: public(hidden, args["weight"], targets, num_items=items, chunk_size=args["chunk_size"]),
                lambda fn: fn(rows, args["weight"], flat, chunk_size=args["chunk_size"]) / items)
    return (lambda: case.call(public, boundaries), lambda fn: case.call(fn, boundaries))


def _median_us(fn: Callable[[], Any], other: Callable[[], Any], calls: int) -> tuple[float, float]:
    """Medians (us) of single calls of ``fn`` and ``other``, interleaved so that both see the same load."""
    a, b = [], []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        t1 = time.perf_counter_ns()
        other()
        t2 = time.perf_counter_ns()
        a.append(t1 - t0)
        b.append(t2 - t1)
    return statistics.median(a) / 1e3, statistics.median(b) / 1e3


def measure(op: str, calls: int, documents: int = 3) -> dict[str, Any]:
    boundaries = PackedBoundaries.from_lengths([5, 7, 4] if documents == 3 else [2] * documents)
    public, direct = _calls(op, boundaries)
    reference = get_backend(op, "torch")
    real_fn = reference.fn
    expected = direct(real_fn)

    def stub(*args: Any, **kwargs: Any) -> Any:
        return expected

    with torch.no_grad():
        reference.__dict__["fn"] = stub  # Backend.fn: the function the selector calls
        try:
            public()  # the single process's warm-up of this key
            op_us, stub_us = _median_us(public, lambda: direct(stub), calls)
        finally:
            reference.__dict__["fn"] = real_fn
        forced, _ = _calls(op, boundaries, backend="torch")  # another key: chosen now, with the real function
        forced()
        real_op_us, real_direct_us = _median_us(forced, lambda: direct(real_fn), max(calls // 10, 50))
    return {"op": op, "overhead_us": op_us - stub_us, "op_with_stub_us": op_us, "stub_direct_us": stub_us,
            "torch_op_us": real_op_us, "torch_direct_us": real_direct_us}


def median_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One op's repeats: each figure's median, and the overheads of all of them (``overhead_us_runs``)."""
    merged = {name: statistics.median(row[name] for row in rows) for name in rows[0] if name != "op"}
    return {"op": rows[0]["op"], **merged, "overhead_us_runs": sorted(row["overhead_us"] for row in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=1, help="measure every op this many times, in turn")
    parser.add_argument("--ops", nargs="+", choices=list(PUBLIC), default=list(PUBLIC), help="the ops to time")
    parser.add_argument("--documents", type=int, default=3, help="documents in the row (3: of 5, 7 and 4 tokens; "
                        "else of 2 tokens each)")
    parser.add_argument("--label", default="after", help="the key the results go under in the JSON (before/after)")
    parser.add_argument("--out", type=Path, default=RESULTS / "dispatch_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [[measure(op, args.calls, args.documents) for op in args.ops] for _ in range(args.repeats)]
    rows = [median_of([run[i] for run in runs]) for i in range(len(args.ops))]
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data[args.label] = {"torch": torch.__version__, "python": platform.python_version(), "calls": args.calls,
                        "repeats": args.repeats, "documents": args.documents, "ops": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"| op | overhead ({args.label}, us; min-max of {args.repeats}) | pure-torch op through dispatch (us) | "
          "called directly (us) |")
    print("|---|---|---|---|")
    for r in rows:
        runs = r["overhead_us_runs"]
        print(f"| {r['op']} | {r['overhead_us']:.1f} ({runs[0]:.1f}-{runs[-1]:.1f}) | {r['torch_op_us']:.0f} | "
              f"{r['torch_direct_us']:.0f} |")


if __name__ == "__main__":
    main()
