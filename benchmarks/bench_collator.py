"""PackingCollator vs transformers' DataCollatorWithFlattening on GSM8K-sized documents.

    .venv/bin/python benchmarks/bench_collator.py           # batches of 2048 / 4096 / 8192 tokens

Documents take the real Qwen3 ChatML lengths of GSM8K train (bundled ``lengths`` table), filled
with random token ids, labels with a masked prompt third, and the four RL keys
(``response_mask``, ``tool_mask``, ``advantages``, ``old_logprobs``). Consecutive documents are
grouped until the next one would overflow the batch size. Inputs come as Python lists (what a
tokenized dataset yields) or as 1-D tensors. Transformers' collator is
``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``; it handles
only ``input_ids`` and ``labels``. Also times ways of turning lists of Python ints into one int64
array, the step that bounds list inputs.

Throughput = tokens collated / time, best of ``--repeats`` passes over the batches, measured both
as wall time and as process CPU time (steadier on a shared machine). Writes
``benchmarks/results/collator.json`` and prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_pack import PackingCollator  # noqa: E402
from hybrid_pack.data import load_lengths  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "collator.json"
KEY_SETS = {
    "input_ids": ("input_ids",),
    "input_ids+labels": ("input_ids", "labels"),
    "all keys": ("input_ids", "labels", "response_mask", "tool_mask", "advantages", "old_logprobs"),
}


def make_batches(capacity: int, num_batches: int, rng: np.random.Generator) -> list[list[dict[str, Any]]]:
    """``num_batches`` lists of documents (every key, Python lists) of at most ``capacity`` tokens each."""
    lengths = rng.permutation(load_lengths("gsm8k_train")["full_chatml"]).tolist()
    batches, batch, used = [], [], 0
    for n in itertools.cycle(lengths):
        if used + n > capacity:
            batches.append(batch)
            if len(batches) == num_batches:
                return batches
            batch, used = [], 0
        ids = rng.integers(0, 151_643, n)
        response = np.arange(n) >= n // 3
        batch.append({
            "input_ids": ids.tolist(),
            "labels": np.where(response, ids, -100).tolist(),
            "response_mask": response.astype(np.int64).tolist(),
            "tool_mask": np.zeros(n, dtype=np.int64).tolist(),
            "advantages": [float(rng.standard_normal())] * n,
            "old_logprobs": (-rng.random(n)).tolist(),
        })
        used += n
    raise AssertionError("unreachable: itertools.cycle never ends")


def select(batches: list[list[dict[str, Any]]], keys: tuple[str, ...], as_tensors: bool) -> list[list[dict[str, Any]]]:
    convert = torch.tensor if as_tensors else (lambda value: value)
    return [[{key: convert(doc[key]) for key in keys} for doc in batch] for batch in batches]


def throughput(collate: Callable[[list[dict[str, Any]]], Any], batches: list[list[dict[str, Any]]],
               repeats: int) -> dict[str, float]:
    """Million tokens / s over all ``batches``: best of ``repeats`` passes, wall clock and process CPU."""
    tokens = sum(len(doc["input_ids"]) for batch in batches for doc in batch)
    best_wall = best_cpu = float("inf")
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            collate(batch)
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return {"wall_mtok_s": tokens / best_wall / 1e6, "cpu_mtok_s": tokens / best_cpu / 1e6,
            "us_per_batch": best_wall / len(batches) * 1e6}


def conversions(batch: list[dict[str, Any]], repeats: int) -> dict[str, float]:
    """Million tokens / s (CPU) of ways to turn the batch's ``input_ids`` lists into one int64 array."""
    lists = [doc["input_ids"] for doc in batch]
    total = sum(map(len, lists))

    def pack_into() -> np.ndarray:
        out, offset = np.empty(total, np.int64), 0
        for values in lists:
            struct.pack_into(f"{len(values)}q", out, offset * 8, *values)
            offset += len(values)
        return out

    methods = {
        "struct.pack_into per document (used)": pack_into,
        "np.fromiter(chain, count=T)": lambda: np.fromiter(itertools.chain.from_iterable(lists), np.int64, total),
        "np.array(list(chain))": lambda: np.array(list(itertools.chain.from_iterable(lists)), np.int64),
        "np.concatenate(np.array per document)": lambda: np.concatenate([np.array(v, np.int64) for v in lists]),
        "torch.tensor(list(chain))": lambda: torch.tensor(list(itertools.chain.from_iterable(lists))),
    }
    results = {}
    for name, method in methods.items():
        best = float("inf")
        for _ in range(repeats):
            start = time.process_time()
            for _ in range(20):
                method()
            best = min(best, (time.process_time() - start) / 20)
        results[name] = total / best / 1e6
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacities", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--batches", type=int, default=32, help="batches per pass")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from transformers import DataCollatorWithFlattening

    ours = PackingCollator()
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    rng = np.random.default_rng(args.seed)
    rows = []
    for capacity in args.capacities:
        batches = make_batches(capacity, args.batches, rng)
        docs_per_batch = float(np.mean([len(batch) for batch in batches]))
        for as_tensors in (False, True):
            for key_set, keys in KEY_SETS.items():
                inputs = select(batches, keys, as_tensors)
                row = {"capacity": capacity, "docs_per_batch": docs_per_batch,
                       "input": "tensors" if as_tensors else "lists", "keys": key_set,
                       "hybrid_pack": throughput(ours, inputs, args.repeats)}
                if key_set != "all keys":
                    row["transformers"] = throughput(theirs, inputs, max(2, args.repeats // 3))
                rows.append(row)
                print(f"T<={capacity} {row['input']:<7} {key_set:<17} "
                      f"hybrid_pack {row['hybrid_pack']['cpu_mtok_s']:6.1f} Mtok/s (CPU)"
                      + (f"  transformers {row['transformers']['cpu_mtok_s']:5.1f}" if "transformers" in row else ""),
                      file=sys.stderr)
    convert = conversions(make_batches(4096, 1, rng)[0], args.repeats)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "collator", "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "numpy": np.__version__, "cpus": os.cpu_count(),
                    "load_average_1min": os.getloadavg()[0]},
        "units": "million tokens per second; best of repeats", "rows": rows, "list_to_int64_conversions": convert,
    }, indent=2) + "\n")

    print("| batch tokens | docs/batch | input | keys | hybrid_pack Mtok/s (CPU / wall) "
          "| transformers Mtok/s (CPU / wall) | speed-up (CPU) |")
    print("|---:|---:|---|---|---:|---:|---:|")
    for row in rows:
        ours_row, theirs_row = row["hybrid_pack"], row.get("transformers")
        theirs_cell = f"{theirs_row['cpu_mtok_s']:.1f} / {theirs_row['wall_mtok_s']:.1f}" if theirs_row else "n/a"
        speedup = f"{ours_row['cpu_mtok_s'] / theirs_row['cpu_mtok_s']:.1f}x" if theirs_row else ""
        print(f"| {row['capacity']} | {row['docs_per_batch']:.1f} | {row['input']} | {row['keys']} "
              f"| {ours_row['cpu_mtok_s']:.1f} / {ours_row['wall_mtok_s']:.1f} | {theirs_cell} | {speedup} |")
    print("\n| list -> int64 conversion (4096-token batch) | Mtok/s (CPU) |\n|---|---:|")
    for name, rate in convert.items():
        print(f"| {name} | {rate:.1f} |")
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
