"""Activation checkpointing under context parallelism on CPU (gloo): activation memory and step time per rank.

    .venv/bin/python benchmarks/bench_activation_checkpointing.py [--ranks 1 2] [--sizes 8192 16384]
        [--models qwen3-next-tiny bamba-tiny] [--layout contiguous zigzag] [--repeats 2]
        [--out benchmarks/results/activation_checkpointing.json]

launches itself under ``torch.distributed.run`` once per group size (1 process: the unsharded row; 2 processes:
context parallelism under each layout; gloo, one thread each). For each native preset (``vocab_size=1024``,
float32) on a row of mixed documents (129 to 2048 tokens) and on one document filling the row, with and
without :func:`hybrid_pack.parallel.apply_activation_checkpointing`, per rank (the max over the ranks):

- activation bytes: the distinct storages one forward keeps for the backward, parameters left out. Autograd's
  saved tensors are seen by ``torch.autograd.graph.saved_tensors_hooks``; a non-reentrant checkpoint saves
  nothing through them (its own hooks take over inside the block) and keeps the block's inputs instead, so
  those (taken by a forward pre-hook on each checkpointed block) are added;
- the step's time: forward + backward, median of ``--repeats`` after one warm-up, wall time of the slowest
  rank and each rank's CPU time (max and mean over the ranks);
- the checkpointed step's loss (summed over the ranks: the row's loss) and gradients against the plain
  step's, same parameters: the largest absolute difference.

Writes ``--out`` and prints markdown tables for docs/benchmarks.md. The machine has 2 cores: 2 ranks use both.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_context_parallel import mixed
from hybrid_pack import PackingCollator
from hybrid_pack.boundaries.sharded import LAYOUTS as CP_LAYOUTS
from hybrid_pack.modeling import from_preset
from hybrid_pack.parallel import apply_activation_checkpointing, shard_batch
from hybrid_pack.parallel.fsdp import decoder_blocks

RESULTS = Path(__file__).resolve().parent / "results" / "activation_checkpointing.json"
VOCAB = 1024


ROWS = {"mixed": mixed, "one document": lambda total: [total]}


def row_batch(lengths: list[int]) -> dict:
    """One packed row of random token ids (vocabulary ``VOCAB``) with labels, documents of ``lengths``."""
    generator = torch.Generator().manual_seed(0)
    features = [{"input_ids": torch.randint(VOCAB, (n,), generator=generator).tolist()} for n in lengths]
    return PackingCollator()(features)


def activation_bytes(model: nn.Module, batch: dict) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages one forward keeps for the backward (parameters left out: autograd's saved
    tensors, and the inputs each checkpointed block keeps), and the loss; runs the backward."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def keep_inputs(_: nn.Module, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                keep(value)

    checkpointed = [block for block in decoder_blocks(model) if hasattr(block, "_checkpoint_wrapped_module")]
    handles = [block.register_forward_pre_hook(keep_inputs, with_kwargs=True) for block in checkpointed]
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model(**batch).loss
    for handle in handles:
        handle.remove()
    loss.backward()
    return sum(storages.values()), loss.detach()


def step_ms(model: nn.Module, batch: dict, repeats: int) -> tuple[float, float]:
    """Medians of one forward + backward's wall time and of this process's CPU time, in ms."""
    wall, cpu = [], []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        began, began_cpu = time.perf_counter(), time.process_time()
        model(**batch).loss.backward()
        wall.append(1e3 * (time.perf_counter() - began))
        cpu.append(1e3 * (time.process_time() - began_cpu))
    return statistics.median(wall), statistics.median(cpu)


def reduce(value: float, op: str) -> float:
    """``value`` reduced over the ranks: ``"max"``, ``"mean"`` or ``"sum"``."""
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(tensor) / (dist.get_world_size() if op == "mean" else 1)


def worker(out: str, models: list[str], sizes: list[int], cp_layouts: list[str], repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    layouts = cp_layouts if world > 1 else ["unsharded"]
    rows = []
    for name in models:
        torch.manual_seed(0)
        model = from_preset(name, vocab_size=VOCAB)
        plain: dict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        for checkpointing in (False, True):
            if checkpointing:
                apply_activation_checkpointing(model)
            for (row, lengths_of), total, layout in itertools.product(ROWS.items(), sizes, layouts):
                whole = row_batch(lengths_of(total))
                batch = whole if world == 1 else shard_batch(whole, layout=layout)
                dist.barrier()
                model.zero_grad(set_to_none=True)
                saved, loss = activation_bytes(model, batch)
                grads = [p.grad.clone() for p in model.parameters()]
                wall, cpu = step_ms(model, batch, repeats)
                record = {"model": name, "row": row, "tokens": total, "ranks": world, "cp_layout": layout,
                          "checkpointing": checkpointing, "repeats": repeats,
                          "activation_bytes_max_per_rank": int(reduce(saved, "max")),
                          "step_ms_slowest_rank": reduce(wall, "max"), "cpu_ms_max": reduce(cpu, "max"),
                          "cpu_ms_mean": reduce(cpu, "mean"), "loss": reduce(float(loss), "sum")}
                key = (row, total, layout)
                if checkpointing:
                    plain_loss, plain_grads = plain[key]
                    grad_difference = max(float((a - b).abs().max()) for a, b in zip(grads, plain_grads))
                    record["loss_difference"] = abs(record["loss"] - plain_loss)
                    record["grad_max_difference"] = reduce(grad_difference, "max")
                else:
                    plain[key] = record["loss"], grads
                rows.append(record)
                if dist.get_rank() == 0:
                    print(json.dumps(record), flush=True)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def tables(rows: list[dict]) -> str:
    """Markdown: one line per (model, row, tokens, ranks, layout), plain against checkpointed."""
    lines = ["| model | row | tokens | ranks | layout | activations per rank (MB), plain / checkpointed | ratio "
             "| step CPU ms per rank (max), plain / checkpointed | slowest rank's wall ms, plain / checkpointed "
             "| loss difference | largest gradient difference |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    plain = {(r["model"], r["row"], r["tokens"], r["ranks"], r["cp_layout"]): r for r in rows if not r["checkpointing"]}
    for r in (r for r in rows if r["checkpointing"]):
        p = plain[r["model"], r["row"], r["tokens"], r["ranks"], r["cp_layout"]]
        saved, saved_plain = r["activation_bytes_max_per_rank"], p["activation_bytes_max_per_rank"]
        lines.append(f"| {r['model']} | {r['row']} | {r['tokens']:,} | {r['ranks']} | {r['cp_layout']} | "
                     f"{saved_plain / 2**20:,.1f} / {saved / 2**20:,.1f} | {saved / saved_plain:.3f} | "
                     f"{p['cpu_ms_max']:,.0f} / {r['cpu_ms_max']:,.0f} | "
                     f"{p['step_ms_slowest_rank']:,.0f} / {r['step_ms_slowest_rank']:,.0f} | "
                     f"{r['loss_difference']:.1e} | {r['grad_max_difference']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--models", nargs="+", default=["qwen3-next-tiny", "bamba-tiny"])
    parser.add_argument("--layout", nargs="+", choices=CP_LAYOUTS, default=list(CP_LAYOUTS))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.models, args.sizes, args.layout, args.repeats)
        return
    results: dict = {"command": " ".join(["benchmarks/bench_activation_checkpointing.py", *sys.argv[1:]]),
                     "torch": torch.__version__, "machine": platform.processor() or "cpu", "cpu_count": os.cpu_count(),
                     "rows": []}
    for ranks in args.ranks:
        part = args.out.with_suffix(f".{ranks}.tmp")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   __file__, "--worker", str(part), "--repeats", str(args.repeats), "--models", *args.models,
                   "--sizes", *map(str, args.sizes), "--layout", *args.layout]
        subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
        results["rows"] += json.loads(part.read_text())
        part.unlink()
    args.out.write_text(json.dumps(results, indent=1))
    print(tables(results["rows"]))


if __name__ == "__main__":
    main()
