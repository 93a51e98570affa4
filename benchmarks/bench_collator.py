"""PackingCollator vs transformers' DataCollatorWithFlattening on GSM8K-sized documents.

    .venv/bin/python benchmarks/bench_collator.py           # batches of 4096 / 8192 tokens

Documents take the real Qwen3 ChatML lengths of GSM8K train (bundled ``lengths`` table), filled
with random token ids, labels with a masked prompt third, and the four RL keys
(``response_mask``, ``tool_mask``, ``advantages``, ``old_logprobs``). Consecutive documents are
grouped until the next one would overflow the batch size. Inputs come as Python lists (what a
tokenized dataset yields), 1-D tensors (``dataset.with_format("torch")``) or NumPy arrays
(``with_format("numpy")``). Transformers' collator is
``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``; it reads only
``input_ids`` and ``labels``, so on "all keys" it is timed on the same input but drops the four
RL keys.

Throughput = tokens collated / time, best of ``--repeats`` passes over the batches, measured both
as wall time and as process CPU time (steadier on a shared machine). For list inputs it also
measures the Python-object floor: ns per token per key of the fastest ways to read the batches'
lists (a bare ``sum``, ``struct.pack_into``, a ``bytes`` join, ``np.fromiter``, ``np.array``).
Writes ``benchmarks/results/collator.json`` and prints markdown tables for docs/collator.md.
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

from hybrid_pack import PackingCollator
from hybrid_pack.data import load_lengths

RESULTS = Path(__file__).resolve().parent / "results" / "collator.json"
KEY_SETS = {
    "input_ids+labels": ("input_ids", "labels"),
    "all keys": ("input_ids", "labels", "response_mask", "tool_mask", "advantages", "old_logprobs"),
}
CONVERTERS: dict[str, Callable[[list[Any]], Any]] = {
    "lists": lambda values: values,
    "tensors": torch.tensor,
    "arrays": np.asarray,
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


def select(batches: list[list[dict[str, Any]]], keys: tuple[str, ...], kind: str) -> list[list[dict[str, Any]]]:
    """The batches with only ``keys``, each value given as ``kind`` (lists, tensors or arrays)."""
    convert = CONVERTERS[kind]
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


def list_floor(batches: list[list[dict[str, Any]]], repeats: int) -> dict[str, dict[str, float | None]]:
    """ns per token, per key, of reading every batch's Python lists: best of ``repeats`` passes (CPU time).

    ``sum`` is the least any reader pays (one visit per object); the others produce an array
    (None: the ``bytes`` join does not apply, values outside 0..255).
    """
    def pack_into(lists: list[list[Any]], code: str) -> None:
        out, offset = np.empty(sum(map(len, lists)), np.int64 if code == "q" else np.float32), 0
        for values in lists:
            struct.pack_into(f"{len(values)}{code}", out, offset * out.itemsize, *values)
            offset += len(values)

    def bytes_join(lists: list[list[Any]], code: str) -> None:
        np.frombuffer(b"".join(map(bytes, lists)), np.uint8).astype(np.int64)

    methods: dict[str, Callable[[list[list[Any]], str], Any]] = {
        "sum (read only)": lambda lists, code: [sum(values) for values in lists],
        "struct.pack_into": pack_into,
        "bytes join (0..255 only)": bytes_join,
        "np.fromiter(chain)": lambda lists, code: np.fromiter(itertools.chain.from_iterable(lists),
                                                              np.int64 if code == "q" else np.float32),
        "np.array(list(chain))": lambda lists, code: np.array(list(itertools.chain.from_iterable(lists)),
                                                             np.int64 if code == "q" else np.float32),
    }
    tokens = sum(len(doc["input_ids"]) for batch in batches for doc in batch)
    results: dict[str, dict[str, float | None]] = {}
    for key in KEY_SETS["all keys"]:
        columns = [[doc[key] for doc in batch] for batch in batches]
        code = "f" if isinstance(columns[0][0][0], float) else "q"
        results[key] = {}
        for name, method in methods.items():
            if name.startswith("bytes") and not all(0 <= v < 256 for c in columns for v in itertools.chain(*c)):
                results[key][name] = None
                continue
            best = float("inf")
            for _ in range(repeats):
                start = time.process_time()
                for lists in columns:
                    method(lists, code)
                best = min(best, time.process_time() - start)
            results[key][name] = best / tokens * 1e9
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacities", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--batches", type=int, default=32, help="batches per pass")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    from transformers import DataCollatorWithFlattening

    ours = PackingCollator()
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    rng = np.random.default_rng(args.seed)
    rows, floor = [], {}
    for capacity in args.capacities:
        batches = make_batches(capacity, args.batches, rng)
        docs_per_batch = float(np.mean([len(batch) for batch in batches]))
        for kind in CONVERTERS:
            for key_set, keys in KEY_SETS.items():
                inputs = select(batches, keys, kind)
                row = {"capacity": capacity, "docs_per_batch": docs_per_batch, "input": kind, "keys": key_set,
                       "hybrid_pack": throughput(ours, inputs, args.repeats),
                       "transformers": throughput(theirs, inputs, max(2, args.repeats // 3))}
                rows.append(row)
                print(f"T<={capacity} {kind:<7} {key_set:<17} hybrid_pack {row['hybrid_pack']['cpu_mtok_s']:6.1f} "
                      f"Mtok/s (CPU)  transformers {row['transformers']['cpu_mtok_s']:5.1f}", file=sys.stderr)
        floor[capacity] = list_floor(batches, args.repeats)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "benchmark": "collator", "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "numpy": np.__version__, "cpus": os.cpu_count(),
                    "load_average_1min": os.getloadavg()[0]},
        "units": "million tokens per second (rows), ns per token (list_floor_ns_per_token); best of repeats",
        "rows": rows, "list_floor_ns_per_token": floor,
    }, indent=2) + "\n")

    print("| batch tokens | docs/batch | input | keys | hybrid_pack Mtok/s (CPU / wall) "
          "| transformers Mtok/s (CPU / wall) | speed-up (CPU) |")
    print("|---:|---:|---|---|---:|---:|---:|")
    for row in rows:
        ours_row, theirs_row = row["hybrid_pack"], row["transformers"]
        print(f"| {row['capacity']} | {row['docs_per_batch']:.1f} | {row['input']} | {row['keys']} "
              f"| {ours_row['cpu_mtok_s']:.1f} / {ours_row['wall_mtok_s']:.1f} "
              f"| {theirs_row['cpu_mtok_s']:.1f} / {theirs_row['wall_mtok_s']:.1f} "
              f"| {ours_row['cpu_mtok_s'] / theirs_row['cpu_mtok_s']:.1f}x |")
    for capacity, per_key in floor.items():
        names = list(next(iter(per_key.values())))
        print(f"\n| {capacity}-token list batches, ns/token | " + " | ".join(names) + " |")
        print("|---|" + "---:|" * len(names))
        for key, methods in per_key.items():
            print(f"| {key} | " + " | ".join("n/a" if methods[n] is None else f"{methods[n]:.1f}" for n in names)
                  + " |")
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
