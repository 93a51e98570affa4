"""Context parallelism on CPU (gloo): each op's time and bytes per rank, and activation memory per rank.

    .venv/bin/python benchmarks/bench_context_parallel.py [--ranks 2 4] [--sizes 4096 ... 65536]

launches itself under ``torch.distributed.run`` once per group size (2 and 4 processes, gloo, one thread
each). For conv (D=64, W=4, silu) and attention (H=4, Hkv=2, D=32, causal), float32, on rows of 4k to 64k
tokens: forward + backward of the op on this rank's shard (the slowest rank's median of ``--repeats``) against
the unsharded op on the same row (one process, while the others wait), and the bytes each rank receives
(the backward sends the same bytes back). Rows: documents of 129 to 2048 tokens ("mixed"), and one document
filling the row ("one document"; attention only up to 16k tokens: its unsharded cost is quadratic).
Activation memory: the bytes autograd saves for backward (``saved_tensors_hooks``, parameters left out) in
one forward of a model on a 8192-token row of mixed documents, per rank against unsharded.

Writes ``benchmarks/results/context_parallel.json`` and prints markdown tables for docs/parallel.md.
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
from hybrid_pack.modeling import HybridConfig, HybridForCausalLM, from_preset
from hybrid_pack.ops import causal_conv1d, varlen_attention
from hybrid_pack.parallel import ShardedBoundaries, shard_batch
from hybrid_pack.parallel.exchange import halo_plan

RESULTS = Path(__file__).resolve().parent / "results" / "context_parallel.json"
MIXED = (700, 1500, 333, 2048, 129)
ONE_DOCUMENT_LIMIT = {"attention": 16_384}
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


def op_call(op: str, total: int) -> tuple[Callable[[PackedBoundaries, slice], torch.Tensor], int | None, int]:
    """``run(boundaries, window)`` (forward + backward on the window's tokens), the halo limit, bytes per token."""
    generator = torch.Generator().manual_seed(0)
    if op == "conv":
        x, weight, bias = (torch.randn(*shape, generator=generator) for shape in ((1, total, 64), (64, 4), (64,)))

        def run(boundaries: PackedBoundaries, window: slice) -> torch.Tensor:
            leaves = [t.detach().requires_grad_() for t in (x[:, window], weight, bias)]
            out = causal_conv1d(*leaves, boundaries, activation="silu")
            out.sum().backward()
            return out

        return run, 3, 64 * 4
    q, k, v = (torch.randn(1, total, heads, 32, generator=generator) for heads in (4, 2, 2))

    def run(boundaries: PackedBoundaries, window: slice) -> torch.Tensor:
        leaves = [t[:, window].detach().requires_grad_() for t in (q, k, v)]
        out = varlen_attention(*leaves, boundaries)
        out.sum().backward()
        return out

    return run, None, 2 * 2 * 32 * 4


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - began))
    return statistics.median(times)


def slowest(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def op_rows(sizes: list[int], repeats: int) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for op, (layout, lengths_of) in itertools.product(("conv", "attention"), LAYOUTS.items()):
        for total in sizes:
            if layout == "one document" and total > ONE_DOCUMENT_LIMIT.get(op, total):
                continue
            row = PackedBoundaries.from_document_lengths(lengths_of(total))
            run, limit, token_bytes = op_call(op, total)
            shard = ShardedBoundaries.from_row(row, group=None, rank=rank, world_size=world)
            window = slice(shard.offset, shard.offset + shard.local.total_tokens)
            unsharded = median_ms(functools.partial(run, row, slice(None)), repeats) if rank == 0 else 0.0
            dist.barrier()
            sharded = slowest(median_ms(functools.partial(run, shard, window), repeats))
            plan = halo_plan(shard, limit)
            received = slowest(plan.halo_tokens * token_bytes)
            rows.append({"op": op, "layout": layout, "tokens": total, "ranks": world,
                         "unsharded_ms": slowest(unsharded), "sharded_ms": sharded,
                         "max_bytes_received_per_rank": int(received)})
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


def memory_rows() -> list[dict]:
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
        unsharded = saved_bytes(model, batch) if rank == 0 else 0
        dist.barrier()
        sharded = slowest(saved_bytes(model, shard_batch(batch)))
        rows.append({"model": name, "tokens": MEMORY_TOKENS, "ranks": world, "unsharded_bytes": int(slowest(unsharded)),
                     "max_bytes_per_rank": int(sharded)})
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    return rows


def worker(out: str, sizes: list[int], repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    record = {"ops": op_rows(sizes, repeats), "memory": memory_rows()}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(record))
    dist.destroy_process_group()


def tables(results: dict) -> str:
    lines = ["| op | row | tokens | ranks | unsharded ms | sharded ms (slowest rank) | bytes received per rank |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results["ops"]:
        lines.append(f"| {r['op']} | {r['layout']} | {r['tokens']:,} | {r['ranks']} | {r['unsharded_ms']:.1f} | "
                     f"{r['sharded_ms']:.1f} | {r['max_bytes_received_per_rank']:,} |")
    lines += ["", "| model | tokens | ranks | activations unsharded (MB) | per rank (MB) | per rank / unsharded |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in results["memory"]:
        lines.append(f"| {r['model']} | {r['tokens']:,} | {r['ranks']} | {r['unsharded_bytes'] / 2**20:.1f} | "
                     f"{r['max_bytes_per_rank'] / 2**20:.1f} | {r['max_bytes_per_rank'] / r['unsharded_bytes']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.sizes, args.repeats)
        return
    results: dict = {"ops": [], "memory": [], "torch": torch.__version__, "machine": platform.processor() or "cpu",
                     "cpu_count": os.cpu_count()}
    for ranks in args.ranks:
        part = RESULTS.with_suffix(f".{ranks}.tmp")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   __file__, "--worker", str(part), "--repeats", str(args.repeats), "--sizes", *map(str, args.sizes)]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
        record = json.loads(part.read_text())
        part.unlink()
        results["ops"] += record["ops"]
        results["memory"] += record["memory"]
    RESULTS.write_text(json.dumps(results, indent=1))
    print(tables(results))


if __name__ == "__main__":
    main()
