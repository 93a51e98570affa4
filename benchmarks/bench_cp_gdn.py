"""The pure-torch Gated DeltaNet context-parallel path before and after widening only the first segment (gloo, CPU).

    .venv/bin/python benchmarks/bench_cp_gdn.py [--tokens 8192] [--repeats 3]

Before (commit 6be0847, ``hybrid_pack/ops/gated_delta/cp.py`` read from git): where the first local segment
continues from the previous rank, the values of the rank's whole slice were widened by ``K`` columns. After: only
the first segment's (the others run once, plain). On 2 ranks, rank 1's slice starts inside a document that began
on rank 0; the rows differ in how much of rank 1's slice that document covers. For each row, rank 1's process CPU
seconds of forward + backward of ``sum(o * weight)`` (best of ``--repeats`` after a warm-up): the path before, the
path after, and the single-device op on the same slice with no state passing at all (the floor). Process CPU time:
the 2 ranks share a 2-core machine with other work, so wall time would measure the scheduler.

H = HV = 4, K = V = 64, float32, torch backend, 1 thread per process. Writes ``benchmarks/results/cp_gdn.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cpu_ranks import arguments, cpu_seconds, print_table, run_ranks, write_result  # noqa: E402
from hybrid_pack import PackedBoundaries  # noqa: E402
from hybrid_pack.ops import gated_delta_rule  # noqa: E402
from hybrid_pack.ops.gated_delta.cp import gated_delta_rule_cp  # noqa: E402
from hybrid_pack.parallel import ShardedBoundaries  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "cp_gdn.json"
BEFORE = "6be0847"
DIMS = {"H": 4, "HV": 4, "K": 64, "V": 64}
FIRST_SEGMENT_SHARES = {"first segment 1/64 of the slice, then 4 documents": 1 / 64,
                        "first segment 1/4 of the slice, then 3 documents": 1 / 4,
                        "first segment 1/2 of the slice, then 2 documents": 1 / 2,
                        "the whole slice one continuing document": 1.0}


def row_of(total: int, share: float) -> PackedBoundaries:
    """Rank 0's half is one document that runs ``share`` of the way into rank 1's half; the rest of rank 1's half is
    split into a few documents."""
    half = total // 2
    first = max(1, int(half * share))
    lengths = [half + first]
    rest = half - first
    pieces = 4 if share < 0.2 else 3 if share < 0.4 else 2
    while rest:
        lengths.append(min(rest, -(-(half - first) // pieces)))
        rest -= lengths[-1]
    return PackedBoundaries.from_document_lengths(lengths)


def path_before() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]]:
    """``gated_delta_rule_cp`` as it was at commit :data:`BEFORE`."""
    source = subprocess.run(["git", "show", f"{BEFORE}:hybrid_pack/ops/gated_delta/cp.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "gated_delta_cp_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("gated_delta_cp_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gated_delta_rule_cp


def measure(shard: ShardedBoundaries, inputs: dict[str, torch.Tensor], weight: torch.Tensor,
            before: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], repeats: int) -> dict[str, float]:
    """This rank's CPU seconds of the path before, the path after and the single-device op on its slice."""
    def sharded(path: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
                ) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        return lambda x: path(gated_delta_rule, x["q"], x["k"], x["v"], x["g"], x["beta"], shard,
                              scale=DIMS["K"] ** -0.5, initial_state=None, output_final_state=False,
                              use_qk_l2norm=False, backend="torch")[0]

    return {"before_cpu_s": cpu_seconds(sharded(before), inputs, weight, repeats),
            "after_cpu_s": cpu_seconds(sharded(gated_delta_rule_cp), inputs, weight, repeats),
            "single_device_cpu_s": cpu_seconds(
                lambda x: gated_delta_rule(*x.values(), shard.local, backend="torch")[0], inputs, weight, repeats)}


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    before = path_before()
    rows = []
    for name, share in FIRST_SEGMENT_SHARES.items():
        row = row_of(args.tokens, share)
        shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=2)
        generator = torch.Generator().manual_seed(0)
        t, h, hv, k, v = shard.local.total_tokens, DIMS["H"], DIMS["HV"], DIMS["K"], DIMS["V"]
        inputs = {"q": torch.randn(1, t, h, k, generator=generator), "k": torch.randn(1, t, h, k, generator=generator),
                  "v": torch.randn(1, t, hv, v, generator=generator),
                  "g": -torch.rand(1, t, hv, generator=generator), "beta": torch.rand(1, t, hv, generator=generator)}
        weight = torch.randn(1, t, hv, v, generator=generator)

        times = measure(shard, inputs, weight, before, args.repeats)
        if rank == 1:
            rows.append({"row": name, "tokens": args.tokens, "rank_1_segments": list(shard.local.segment_lengths),
                         **times, "after_over_before": times["after_cpu_s"] / times["before_cpu_s"],
                         "after_over_single_device": times["after_cpu_s"] / times["single_device_cpu_s"]})
    if rank == 1:
        Path(args.worker).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = arguments(__doc__, RESULTS, repeats=3)
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    rows = run_ranks(__file__, 2, args.out, "--tokens", str(args.tokens), "--repeats", str(args.repeats))
    write_result(args.out, "pure-torch Gated DeltaNet CP path, widened first segment only vs whole slice (before), "
                           "rank 1 of 2, forward+backward", rows,
                 before=BEFORE, dims=DIMS, dtype="float32", backend="torch", repeats=args.repeats)
    print_table(["rank 1's slice", "before s", "after s", "single-device s", "after / before", "after / single-device"],
                ([r["row"], f"{r['before_cpu_s']:.3f}", f"{r['after_cpu_s']:.3f}", f"{r['single_device_cpu_s']:.3f}",
                  f"{r['after_over_before']:.2f}", f"{r['after_over_single_device']:.2f}"] for r in rows))


if __name__ == "__main__":
    main()
