"""Compile time per static shape, and compiled against eager step time of packed training (CPU).

    python benchmarks/bench_compile.py [--steps 8] [--presets qwen3-next-tiny bamba-tiny ...] [--shapes 1024:16 ...]

For each preset and static shape ``(L, M)``: ``torch.compile(model, fullgraph=True)`` (inductor) on static
batches of ``PackingCollator(pack_length=L, max_documents=M)``, against the eager model on the plain batches of
the same documents. A step is one forward and backward of one packed row (1 to M documents, 75-100% full);
eager and compiled steps alternate. Reports the first compiled step (the compilation, forward and backward;
inductor's caches off), the median step time of each, and how many graphs were compiled (1: no recompile across
layouts). Writes benchmarks/results/compile.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch._inductor.config
from torch._dynamo.utils import counters

from hybrid_pack import PackingCollator
from hybrid_pack.modeling import from_preset

RESULTS = Path(__file__).parent / "results" / "compile.json"
SHAPES = {"tiny": [(512, 8), (1024, 16)], "small": [(512, 8)]}


def documents(pack_length: int, max_documents: int, vocab_size: int, rng: np.random.Generator) -> list[dict]:
    """1 to ``max_documents`` documents filling 75-100% of the row."""
    count = int(rng.integers(1, max_documents + 1))
    tokens = int(rng.integers(max(count, 3 * pack_length // 4), pack_length + 1))
    cuts = np.sort(rng.choice(np.arange(1, tokens), count - 1, replace=False)) if count > 1 else np.array([], int)
    lengths = np.diff(np.concatenate([[0], cuts, [tokens]]))
    return [{"input_ids": torch.from_numpy(rng.integers(1, vocab_size, n))} for n in lengths]


def timed_step(model: torch.nn.Module, call: torch.nn.Module, batch: dict) -> float:
    began = time.perf_counter()
    model.zero_grad(set_to_none=True)
    call(**batch).loss.backward()
    return time.perf_counter() - began


def measure(preset: str, pack_length: int, max_documents: int, steps: int) -> dict:
    torch.manual_seed(0)
    model = from_preset(preset)
    rng = np.random.default_rng(0)
    rows = [documents(pack_length, max_documents, model.config.vocab_size, rng) for _ in range(steps + 1)]
    plain = PackingCollator(pack_length=pack_length)
    static = PackingCollator(pack_length=pack_length, max_documents=max_documents)
    torch._dynamo.reset()
    counters.clear()
    compiled_model = torch.compile(model, fullgraph=True)
    eager, compiled = [], []
    for row in rows:  # interleaved, so a busy machine slows both alike
        eager.append(timed_step(model, model, plain(row)))
        compiled.append(timed_step(model, compiled_model, static(row)))
    row = {"preset": preset, "pack_length": pack_length, "max_documents": max_documents, "steps": steps,
           "threads": torch.get_num_threads(), "compile_seconds": compiled[0],
           "eager_step_seconds": statistics.median(eager[1:]), "compiled_step_seconds": statistics.median(compiled[1:]),
           "graphs_compiled": counters["stats"]["unique_graphs"],
           "graph_breaks": sum(counters["graph_break"].values())}
    row["speedup"] = row["eager_step_seconds"] / row["compiled_step_seconds"]
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    torch._inductor.config.force_disable_caches = True  # a cold compile, as on a fresh machine
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--presets", nargs="+", default=["qwen3-next-tiny", "bamba-tiny", "qwen3-next-small",
                                                         "bamba-small"])
    parser.add_argument("--shapes", nargs="+", metavar="L:M", default=None,
                        help="static shapes (pack length : max documents) for every preset; default per size")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    given = [tuple(int(n) for n in shape.split(":")) for shape in args.shapes] if args.shapes else None
    rows = [measure(preset, length, docs, args.steps)
            for preset in args.presets for length, docs in given or SHAPES[preset.rsplit("-", 1)[-1]]]
    args.out.write_text(json.dumps(rows, indent=1))
    print("| preset | L | M | compile (s) | eager step (ms) | compiled step (ms) | speed-up | graphs |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['preset']} | {r['pack_length']} | {r['max_documents']} | {r['compile_seconds']:.0f} | "
              f"{1e3 * r['eager_step_seconds']:.0f} | {1e3 * r['compiled_step_seconds']:.0f} | {r['speedup']:.2f}x | "
              f"{r['graphs_compiled']} |")


if __name__ == "__main__":
    main()
