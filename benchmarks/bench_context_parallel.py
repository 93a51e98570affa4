"""Context parallelism on CPU (gloo): each op's time and bytes per rank, and activation memory per rank.

    .venv/bin/python benchmarks/bench_context_parallel.py [--ranks 2 4] [--sizes 16384 32768 65536]
        [--layout contiguous zigzag] [--repeats 3] [--quadratic-repeats 1]
        [--out benchmarks/results/context_parallel.json]

launches itself under ``torch.distributed.run`` once per group size (2 and 4 processes, gloo, one thread
each). For conv (D=64, W=4, silu) and attention (H=4, Hkv=2, D=32, causal), float32, on rows of 16k to 64k
tokens (by default), under each layout: forward + backward of the op on this rank's shard (median of
``--repeats``: the slowest rank's wall time, and each rank's own CPU time, max and mean over the ranks: the
balance) against the unsharded op on the same row (one process, while the others wait), the speed-up
(unsharded over the slowest rank's wall time), and the bytes each rank receives from other ranks (the
backward sends the same bytes back). Rows: documents of 129 to 2048 tokens ("mixed"), and one document
filling the row ("one document"). One-document attention rows longer than 16k tokens are timed
``--quadratic-repeats`` times (after one warm-up): their cost is quadratic in the row (the unsharded 64k row
takes about a minute per forward + backward on one core). Activation memory: the bytes autograd saves for
backward (``saved_tensors_hooks``, parameters left out) in one forward of a model on a 8192-token row of
mixed documents, per rank against unsharded, under each layout (bench_activation_checkpointing.py measures
the same with activation checkpointing).

Writes ``--out`` (``benchmarks/results/context_parallel.json``) and prints markdown tables for docs/parallel.md.
The machine has 2 cores: 4 ranks oversubscribe it, so their times are upper bounds.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.boundaries.sharded import LAYOUTS as CP_LAYOUTS
from hybrid_pack.modeling import HybridConfig, HybridForCausalLM, from_preset
from hybrid_pack.ops import causal_conv1d, varlen_attention
from hybrid_pack.ops.cp.exchange import halo_plan
from hybrid_pack.parallel import ShardedBoundaries, shard_batch

RESULTS = Path(__file__).resolve().parent / "results" / "context_parallel.json"
MIXED = (700, 1500, 333, 2048, 129)
QUADRATIC_ROW = 16_384
"""One-document attention rows longer than this many tokens get ``--quadratic-repeats`` repeats."""
MEMORY_TOKENS = 8192


def mixed(total: int) -> list[int]:
    """Documents cycling through 700, 1500, 333, 2048 and 129 tokens until the row is full."""
    lengths: list[int] = []
    for length in itertools.cycle(MIXED):
        room = total - sum(lengths)
        if room <= 0:
            return lengths
        lengths.append(min(length, room))
    return lengths


LAYOUTS: dict[str, Callable[[int], list[int]]] = {"mixed": mixed, "one document": lambda total: [total]}


Tokens = Callable[[torch.Tensor], torch.Tensor]
"""A whole-row ``[1, T, ...]`` tensor -> the tokens one process runs on (all of them, or a shard's)."""


def op_call(op: str, total: int) -> tuple[Callable[[PackedBoundaries, Tokens], torch.Tensor], int | None, int]:
    """``run(boundaries, tokens)`` (forward + backward on those tokens), the halo limit, bytes per token."""
    generator = torch.Generator().manual_seed(0)
    if op == "conv":
        x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((1, total, 64), (64, 4), (64,)))

        def run(boundaries: PackedBoundaries, tokens: Tokens) -> torch.Tensor:
            leaves = [t.detach().requires_grad_() for t in (tokens(x), weight, bias)]
            out = causal_conv1d(*leaves, boundaries, activation="silu")
            out.sum().backward()
            return out

        return run, 3, 64 * 4
    q, k, v = (torch.randn(1, total, heads, 32, generator=generator) for heads in (4, 2, 2))

    def run(boundaries: PackedBoundaries, tokens: Tokens) -> torch.Tensor:
        leaves = [tokens(t).detach().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*leaves, boundaries)
        out.sum().backward()
        return out

    return run, None, 2 * 2 * 32 * 4


def median_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Medians of ``fn()``'s wall time and of this process's CPU time, in ms (ranks that wait on each other in
    an exchange share its wall time; the CPU time is each rank's own work)."""
    fn()  # warm-up
    wall, cpu = [], []
    for _ in range(repeats):
        began, began_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(1e3 * (time.perf_counter() - began))
        cpu.append(1e3 * (time.process_time() - began_cpu))
    return statistics.median(wall), statistics.median(cpu)


def slowest(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def mean(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor) / dist.get_world_size()


def op_rows(sizes: list[int], repeats: int, quadratic_repeats: int, cp_layouts: list[str]) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for op, (layout, lengths_of) in itertools.product(("conv", "attention"), LAYOUTS.items()):
        for total in sizes:
            quadratic = op == "attention" and layout == "one document" and total > QUADRATIC_ROW
            repeats_here = quadratic_repeats if quadratic else repeats
            row = PackedBoundaries.from_document_lengths(lengths_of(total))
            run, limit, token_bytes = op_call(op, total)
            whole_row = functools.partial(run, row, lambda t: t)
            unsharded = slowest(median_ms(whole_row, repeats_here)[0] if rank == 0 else 0.0)
            for cp_layout in cp_layouts:
                shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world, layout=cp_layout)
                dist.barrier()
                sharded, cpu = median_ms(functools.partial(run, shard, shard.take), repeats_here)
                received = sum(count for _, count in halo_plan(shard, limit).exchange.receives) * token_bytes
                rows.append({"op": op, "layout": layout, "cp_layout": cp_layout, "tokens": total, "ranks": world,
                             "repeats": repeats_here,
                             "unsharded_ms": unsharded, "sharded_ms": slowest(sharded), "cpu_ms_max": slowest(cpu),
                             "cpu_ms_mean": mean(cpu), "max_bytes_received_per_rank": int(slowest(received))})
                rows[-1]["speedup"] = unsharded / rows[-1]["sharded_ms"]
                if rank == 0:
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def saved_bytes(model: torch.nn.Module, batch: dict) -> int:
    """Bytes of the distinct storages autograd saves for backward in one forward (parameters left out)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(**batch).loss
    loss.backward()
    return sum(storages.values())


def memory_rows(cp_layouts: list[str]) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    models = {
        "attention model (AA)": lambda: HybridForCausalLM(HybridConfig(layer_pattern="AA", vocab_size=1024)),
        "qwen3-next-tiny": lambda: from_preset("qwen3-next-tiny", vocab_size=1024),
        "bamba-tiny": lambda: from_preset("bamba-tiny", vocab_size=1024),
    }
    generator = torch.Generator().manual_seed(0)
    features = [{"input_ids": torch.randint(1024, (n,), generator=generator).tolist()} for n in mixed(MEMORY_TOKENS)]
    batch = PackingCollator()(features)
    rows = []
    for name, make in models.items():
        torch.manual_seed(0)
        model = make()
        unsharded = int(slowest(saved_bytes(model, batch) if rank == 0 else 0))
        for cp_layout in cp_layouts:
            dist.barrier()
            sharded = slowest(saved_bytes(model, shard_batch(batch, layout=cp_layout)))
            rows.append({"model": name, "cp_layout": cp_layout, "tokens": MEMORY_TOKENS, "ranks": world,
                         "unsharded_bytes": unsharded, "max_bytes_per_rank": int(sharded)})
            if rank == 0:
                print(json.dumps(rows[-1]), flush=True)
    return rows


def worker(out: str, sizes: list[int], repeats: int, quadratic_repeats: int, cp_layouts: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    record = {"ops": op_rows(sizes, repeats, quadratic_repeats, cp_layouts), "memory": memory_rows(cp_layouts)}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()


def tables(results: dict) -> str:
    lines = ["| op | row | layout | tokens | ranks | unsharded ms | sharded ms (slowest rank) | speed-up "
             "| CPU ms per rank, max / mean | max / mean | bytes received per rank |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results["ops"]:
        lines.append(f"| {r['op']} | {r['layout']} | {r['cp_layout']} | {r['tokens']:,} | {r['ranks']} | "
                     f"{r['unsharded_ms']:.1f} | {r['sharded_ms']:.1f} | {r['speedup']:.2f} | "
                     f"{r['cpu_ms_max']:.1f} / {r['cpu_ms_mean']:.1f} | {r['cpu_ms_max'] / r['cpu_ms_mean']:.2f} | "
                     f"{r['max_bytes_received_per_rank']:,} |")
    lines += ["", "| model | layout | tokens | ranks | activations unsharded (MB) | per rank (MB) "
              "| per rank / unsharded |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in results["memory"]:
        lines.append(f"| {r['model']} | {r['cp_layout']} | {r['tokens']:,} | {r['ranks']} | "
                     f"{r['unsharded_bytes'] / 2**20:.1f} | {r['max_bytes_per_rank'] / 2**20:.1f} | "
                     f"{r['max_bytes_per_rank'] / r['unsharded_bytes']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16384, 32768, 65536])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quadratic-repeats", type=int, default=1,
                        help=f"repeats of one-document attention rows over {QUADRATIC_ROW} tokens")
    parser.add_argument("--layout", nargs="+", choices=CP_LAYOUTS, default=list(CP_LAYOUTS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.sizes, args.repeats, args.quadratic_repeats, args.layout)
        return
    results: dict = {"command": " ".join(["benchmarks/bench_context_parallel.py", *sys.argv[1:]]),
                     "torch": torch.__version__, "machine": platform.processor() or "cpu", "cpu_count": os.cpu_count(),
                     "ops": [], "memory": []}
    for ranks in args.ranks:
        part = args.out.with_suffix(f".{ranks}.tmp")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   __file__, "--worker", str(part), "--repeats", str(args.repeats),
                   "--quadratic-repeats", str(args.quadratic_repeats), "--sizes", *map(str, args.sizes),
                   "--layout", *args.layout]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
        record = json.loads(part.read_text())
        part.unlink()
        results["ops"] += record["ops"]
        results["memory"] += record["memory"]
    args.out.write_text(json.dumps(results, indent=1))
    print(tables(results))


if __name__ == "__main__":
    main()
