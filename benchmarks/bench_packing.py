"""Packing planner: speed and pack count of every strategy on the bundled length distributions.

    .venv/bin/python benchmarks/bench_packing.py                      # 1M and 10M lengths, capacity 4096
    .venv/bin/python benchmarks/bench_packing.py --sizes 100000 --no-trl

Each distribution is one bundled Qwen3 length table (``hybrid_pack.data.load_lengths``: GSM8K
train / test and Arena-Hard Sky-T1 answers; ``full_chatml``, ``last_turn_prompt``,
``last_turn_response``), sampled with replacement to ``--sizes`` lengths (numpy seed 0). Every
strategy plans the first size; ``--scale-strategies`` also plan the larger ones. Overflow is
``"split"`` (Sky-T1 chats reach 8,592 tokens). Times are the best of ``--repeats`` calls to
``plan_packs`` after numba's JIT warm-up, single-threaded, as wall time and as process CPU time
(steadier on a shared machine). ``gap`` is packs above ``ceil(tokens / capacity)``.

If ``trl`` is importable, its ``pack_dataset(..., strategy="bfd")`` packs the GSM8K-train
``full_chatml`` sample too (a ``datasets.Dataset`` of ``input_ids`` with those lengths), once
with one ``map`` batch over the whole dataset (global BFD, comparable with ``plan_packs``) and
once with the default ``map`` batches of 1,000 examples; each run is killed after
``--trl-timeout`` seconds. Writes ``benchmarks/results/packing.json`` and prints markdown tables
for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_pack import plan_packs
from hybrid_pack.data import LENGTH_TABLES, load_lengths
from hybrid_pack.packing.plan import STRATEGIES

RESULTS = Path(__file__).resolve().parent / "results" / "packing.json"
TRL_DISTRIBUTION = "gsm8k_train/full_chatml"


def distributions() -> dict[str, np.ndarray]:
    """Every bundled length table column, by ``table/column``."""
    return {f"{table}/{column}": lengths
            for table in LENGTH_TABLES for column, lengths in load_lengths(table).items()}


def time_plan(lengths: np.ndarray, capacity: int, strategy: str, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` wall and CPU seconds of one ``plan_packs`` call, and the plan's figures."""
    wall, cpu = [], []
    for _ in range(repeats):
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        plan = plan_packs(lengths, capacity, strategy=strategy, overflow="split")
        cpu.append(time.process_time() - cpu_start)
        wall.append(time.perf_counter() - wall_start)
    return {
        "strategy": strategy,
        "num_lengths": int(lengths.size),
        "wall_s": min(wall),
        "cpu_s": min(cpu),
        "packs": len(plan),
        "lower_bound": plan.lower_bound,
        "gap": len(plan) - plan.lower_bound,
        "gap_percent": 100 * (len(plan) - plan.lower_bound) / plan.lower_bound,
        "efficiency": plan.efficiency,
    }


def trl_worker(lengths_file: str, capacity: int, batch_size: int | None) -> None:
    """Run TRL's BFD on a dataset with the given lengths and print its time and pack count as JSON."""
    import datasets
    import pyarrow as pa
    from trl import pack_dataset

    lengths = np.load(lengths_file)
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = pa.array(np.zeros(int(offsets[-1]), np.int32))
    input_ids = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    dataset = datasets.Dataset(pa.table({"input_ids": input_ids}))
    map_kwargs = {"batch_size": batch_size or len(dataset)}
    start = time.perf_counter()
    packed = pack_dataset(dataset, capacity, strategy="bfd", map_kwargs=map_kwargs)
    seconds = time.perf_counter() - start
    print(json.dumps({"wall_s": seconds, "packs": len(packed)}))


def time_trl(lengths: np.ndarray, capacity: int, batch_size: int | None, timeout: float) -> dict[str, Any]:
    """TRL ``pack_dataset`` in a subprocess; ``{"skipped": reason}`` on timeout or failure."""
    with tempfile.TemporaryDirectory() as tmp:
        lengths_file = os.path.join(tmp, "lengths.npy")
        np.save(lengths_file, lengths)
        command = [sys.executable, __file__, "--trl-worker", lengths_file, "--capacity", str(capacity)]
        if batch_size:
            command += ["--trl-batch-size", str(batch_size)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=True)
        except subprocess.TimeoutExpired:
            return {"skipped": f"took over {timeout:.0f} s"}
        except subprocess.CalledProcessError as err:
            return {"skipped": f"failed: {err.stderr.strip().splitlines()[-1]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(results: dict[str, Any]) -> str:
    sizes, header = results["sizes"], " | ".join(STRATEGIES)
    lines = [f"Packs above the lower bound ceil(tokens / {results['capacity']}), {sizes[0]:,} lengths:", "",
             f"| distribution | lower bound | {header} |", "|---|---:|" + "---:|" * len(STRATEGIES)]
    for name, runs in results["strategies"].items():
        cells = [f"+{run['gap']:,} ({run['gap_percent']:.3f}%)" for run in runs]
        lines.append(f"| {name} | {runs[0]['lower_bound']:,} | " + " | ".join(cells) + " |")
    lines += ["", f"Seconds per plan_packs call, {sizes[0]:,} lengths (CPU s / wall s):", "",
              f"| distribution | {header} |", "|---|" + "---:|" * len(STRATEGIES)]
    for name, runs in results["strategies"].items():
        lines.append(f"| {name} | " + " | ".join(f"{run['cpu_s']:.3f} / {run['wall_s']:.3f}" for run in runs) + " |")
    if any(results["scaling"].values()):
        lines += ["", "Larger inputs:", "",
                  "| distribution | strategy | lengths | CPU s | wall s | packs above lower bound |",
                  "|---|---|---:|---:|---:|---:|"]
        for name, runs in results["scaling"].items():
            lines += [f"| {name} | {run['strategy']} | {run['num_lengths']:,} | {run['cpu_s']:.2f} | "
                      f"{run['wall_s']:.2f} | +{run['gap']:,} ({run['gap_percent']:.3f}%) |" for run in runs]
    if results["trl"]:
        trl = results["trl"]
        lines += ["", f"TRL {trl['trl_version']} `pack_dataset(strategy=\"bfd\")` vs `plan_packs(strategy=\"bfd\")`, "
                  f"{TRL_DISTRIBUTION}, {sizes[0]:,} lengths:", "",
                  "| packer | wall s | packs |", "|---|---:|---:|",
                  f"| hybrid_pack plan_packs | {trl['plan_packs']['wall_s']:.2f} | {trl['plan_packs']['packs']:,} |"]
        for label, run in (("TRL, one map batch (global BFD)", trl["global"]),
                           ("TRL, default map batches of 1,000", trl["batched"])):
            lines.append(f"| {label} | {run['skipped']} | - |" if "skipped" in run
                         else f"| {label} | {run['wall_s']:.2f} | {run['packs']:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale-strategies", nargs="+", default=["bfd", "knapsack"], choices=STRATEGIES)
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL comparison")
    parser.add_argument("--trl-timeout", type=float, default=90.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    parser.add_argument("--trl-batch-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker, args.capacity, args.trl_batch_size)
        return

    for strategy in STRATEGIES:
        plan_packs(np.arange(1, 100), args.capacity, strategy=strategy, overflow="split")
    rng = np.random.default_rng(0)
    samples = {name: {n: rng.choice(lengths, n) for n in args.sizes} for name, lengths in distributions().items()}
    first = args.sizes[0]
    results: dict[str, Any] = {
        "capacity": args.capacity, "sizes": args.sizes, "repeats": args.repeats,
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpu_count": os.cpu_count(), "load_average": os.getloadavg()},
        "strategies": {}, "scaling": {}, "trl": {},
    }
    for name, by_size in samples.items():
        results["strategies"][name] = [time_plan(by_size[first], args.capacity, s, args.repeats) for s in STRATEGIES]
        results["scaling"][name] = [time_plan(by_size[n], args.capacity, s, args.repeats)
                                    for s in args.scale_strategies for n in args.sizes[1:]]
        print(f"{name}: done", file=sys.stderr, flush=True)

    if importlib.util.find_spec("trl") is not None and not args.no_trl:
        lengths = samples[TRL_DISTRIBUTION][first]
        results["trl"] = {
            "trl_version": importlib.metadata.version("trl"),
            "plan_packs": time_plan(lengths, args.capacity, "bfd", args.repeats),
            "global": time_trl(lengths, args.capacity, None, args.trl_timeout),
            "batched": time_trl(lengths, args.capacity, 1000, args.trl_timeout),
        }

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown(results))
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
