"""Gated DeltaNet and the SSD split across a context-parallel group (gloo, CPU) against the unsharded op.

    .venv/bin/python benchmarks/bench_cp_recurrent.py [--ranks 2 4] [--tokens 4096 ... 65536]

Times forward + backward of ``sum(out * weight)``: the unsharded op on the whole row in this process
alone, then, for each group size, one ``torch.distributed.run`` launch of this script (``--worker``)
runs each rank's slice through ``ShardedBoundaries`` (all ranks at once) and counts the bytes each rank
passes to the collectives (forward all-gather and backward all-reduce of the state summaries). Times
are process CPU seconds, best of ``--repeats``: on a 2-core machine shared with other work, R
processes cannot run side by side, so wall time would measure the scheduler; per-rank CPU time is
the work one device would do (R processes sharing 2 cores still slow each other: the sharded times
are, if anything, pessimistic). The row's documents have random
lengths (about ``--docs-per-4k`` per 4096 tokens), so documents cross rank edges.

Tiny dims (GDN H=HV=2, K=V=16; SSD H=4, P=8, G=1, N=16), float32, torch backend, 1 thread per process.
Writes ``benchmarks/results/cp_recurrent.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_ranks import arguments, cpu_seconds, print_table, run_ranks, write_result
from hybrid_pack import PackedBoundaries
from hybrid_pack.ops import gated_delta_rule, mamba2_ssd
from hybrid_pack.parallel import ShardedBoundaries

RESULTS = Path(__file__).resolve().parent / "results" / "cp_recurrent.json"
GDN = {"H": 2, "HV": 2, "K": 16, "V": 16}
SSD = {"H": 4, "P": 8, "G": 1, "N": 16, "chunk_size": 64}


def document_lengths(total: int, num_docs: int, rng: np.random.Generator) -> list[int]:
    """``num_docs`` positive lengths summing to ``total``, cut at distinct random points."""
    cuts = np.sort(rng.choice(np.arange(1, total), size=num_docs - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).tolist()


def gdn_inputs(total: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {"q": randn(1, total, GDN["H"], GDN["K"]), "k": randn(1, total, GDN["H"], GDN["K"]),
            "v": randn(1, total, GDN["HV"], GDN["V"]), "g": -torch.rand(1, total, GDN["HV"], generator=generator),
            "beta": torch.rand(1, total, GDN["HV"], generator=generator)}


def ssd_inputs(total: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return {"x": randn(1, total, SSD["H"], SSD["P"]), "dt": randn(1, total, SSD["H"]),
            "A": -torch.rand(SSD["H"], generator=generator) - 0.5,
            "B": randn(1, total, SSD["G"], SSD["N"]), "C": randn(1, total, SSD["G"], SSD["N"])}


def run_gdn(inputs: dict[str, torch.Tensor], boundaries: PackedBoundaries) -> torch.Tensor:
    names = ("q", "k", "v", "g", "beta")
    return gated_delta_rule(*(inputs[n] for n in names), boundaries, backend="torch")[0]


def run_ssd(inputs: dict[str, torch.Tensor], boundaries: PackedBoundaries) -> torch.Tensor:
    names = ("x", "dt", "A", "B", "C")
    return mamba2_ssd(*(inputs[n] for n in names), boundaries, chunk_size=SSD["chunk_size"], backend="torch")


OPS: dict[str, tuple[Callable, Callable]] = {"gated_delta": (gdn_inputs, run_gdn), "ssd": (ssd_inputs, run_ssd)}
TOKEN_DIM = {"q": 1, "k": 1, "v": 1, "g": 1, "beta": 1, "x": 1, "dt": 1, "B": 1, "C": 1}


class ByteCounter:
    """Counts the bytes this process hands to ``all_gather`` and ``all_reduce``."""

    def __init__(self) -> None:
        self.sent = 0
        self._gather, self._reduce = dist.all_gather, dist.all_reduce

        def gather(output: list[torch.Tensor], tensor: torch.Tensor, *args, **kwargs):
            self.sent += tensor.numel() * tensor.element_size()
            return self._gather(output, tensor, *args, **kwargs)

        def reduce(tensor: torch.Tensor, *args, **kwargs):
            self.sent += tensor.numel() * tensor.element_size()
            return self._reduce(tensor, *args, **kwargs)

        dist.all_gather, dist.all_reduce = gather, reduce


def row_of(total: int, args: argparse.Namespace) -> PackedBoundaries:
    """The benchmark's row of ``total`` tokens (the same in every process)."""
    num_docs = max(2, args.docs_per_4k * total // 4096)
    return PackedBoundaries.from_lengths(document_lengths(total, num_docs, np.random.default_rng(args.seed + total)))


def inputs_and_weight(op: str, row: PackedBoundaries, args: argparse.Namespace
                      ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    make_inputs, fn = OPS[op]
    generator = torch.Generator().manual_seed(args.seed)
    inputs = make_inputs(row.total_tokens, generator)
    return inputs, torch.randn(fn(inputs, row).shape, generator=generator)


def unsharded_times(args: argparse.Namespace) -> dict[tuple[str, int], float]:
    """Every op on every whole row, in this process alone (nothing else of the benchmark running)."""
    torch.set_num_threads(1)
    times = {}
    for total in args.tokens:
        row = row_of(total, args)
        for op, (_, fn) in OPS.items():
            inputs, weight = inputs_and_weight(op, row, args)
            times[op, total] = cpu_seconds(functools.partial(fn, boundaries=row), inputs, weight, args.repeats)
    return times


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    counter = ByteCounter()
    rows = []
    for total in args.tokens:
        row = row_of(total, args)
        sharded = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world_size)
        lo, hi = sharded.offset, sharded.offset + sharded.local.total_tokens
        for op, (_, fn) in OPS.items():
            inputs, weight = inputs_and_weight(op, row, args)
            local = {n: x[:, lo:hi] if n in TOKEN_DIM else x for n, x in inputs.items()}
            counter.sent = 0
            sharded_s = cpu_seconds(functools.partial(fn, boundaries=sharded), local, weight[:, lo:hi], args.repeats)
            sent_per_call = counter.sent // (args.repeats + 1)  # one forward + backward
            per_rank = [torch.zeros(2, dtype=torch.float64) for _ in range(world_size)]
            dist.all_gather(per_rank, torch.tensor([sharded_s, sent_per_call], dtype=torch.float64))
            if rank == 0:
                rows.append({"op": op, "tokens": total, "ranks": world_size, "documents": row.num_docs,
                             "sharded_cpu_s_per_rank": [t[0].item() for t in per_rank],
                             "bytes_sent_per_rank": [int(t[1].item()) for t in per_rank]})
    if rank == 0:
        Path(args.worker).write_text(json.dumps(rows))
    dist.destroy_process_group()


def table_line(r: dict) -> list[object]:
    """One row's line of the printed table."""
    slowest = max(r["sharded_cpu_s_per_rank"])
    sent = sorted(set(r["bytes_sent_per_rank"]))
    return [r["op"], r["ranks"], r["tokens"], f"{r['unsharded_cpu_s']:.3f}", f"{slowest:.3f}",
            f"{slowest / r['unsharded_cpu_s']:.2f}", ", ".join(map(str, sent))]


def main() -> None:
    parser = arguments(__doc__, RESULTS, repeats=2)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--docs-per-4k", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    print("unsharded, this process alone ...", flush=True)
    unsharded = unsharded_times(args)
    rows = []
    for ranks in args.ranks:
        print(f"{ranks} ranks: {len(args.tokens)} row lengths x {len(OPS)} ops ...", flush=True)
        sharded = run_ranks(__file__, ranks, args.out, "--tokens", *map(str, args.tokens),
                            "--docs-per-4k", str(args.docs_per_4k), "--repeats", str(args.repeats),
                            "--seed", str(args.seed))
        rows += [{**r, "unsharded_cpu_s": unsharded[r["op"], r["tokens"]]} for r in sharded]

    write_result(args.out, "Gated DeltaNet and SSD context parallelism (gloo, CPU) vs the unsharded op, "
                           "forward+backward",
                 rows, dims={"gated_delta": GDN, "ssd": SSD}, dtype="float32", backend="torch", repeats=args.repeats)
    print_table(["op", "ranks", "tokens", "unsharded CPU s", "slowest rank CPU s", "ratio", "bytes sent per rank"],
                map(table_line, rows))


if __name__ == "__main__":
    main()
