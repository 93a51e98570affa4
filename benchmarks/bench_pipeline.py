"""The data pipeline at scale: streaming packing, rank balance, RL rollout packing, datasets tokenise-and-plan.

    .venv/bin/python benchmarks/bench_pipeline.py            # full run (several minutes on 2 cores)
    .venv/bin/python benchmarks/bench_pipeline.py --quick    # small sizes, a smoke test

1. Streaming: ``pack_stream`` (BFD, 10,000-example buffer, capacity 8192) over the bundled
   Arena-Hard / Sky-T1 ``full_chatml`` lengths resampled with replacement to 200k examples,
   against the offline plan of the same examples and the lower bound ``ceil(tokens / capacity)``.
2. Rank balance: ``PackedBatchSampler`` on 8 ranks (GSM8K train lengths as they are; Arena lengths
   resampled to 200k), the worst of epochs 0-2, next to a naive layout (packs shuffled and dealt
   round-robin, as a DistributedSampler over packs would). ``epoch`` = most loaded rank's epoch
   cost over the mean; ``step`` = sum over steps of the slowest rank's cost over the mean rank's.
3. RL rollouts: ``pack_rollouts`` of 4096 rollouts (prompt / response lengths resampled from the
   bundled ``last_turn_prompt`` / ``last_turn_response`` tables) at capacity 16384: the packing
   decision (``plan_packs`` on the lengths, median of 50 runs) and the full build of the batches.
4. Tokenise-and-plan: ``tokenize_and_plan`` (Qwen3 tokenizer, capacity 4096, ``Dataset.map``
   without and with worker processes) on synthetic texts (Shakespeare words, log-normal word
   counts, ~129 tokens each) stored on disk, two sizes, each run in a fresh process: wall time and
   peak anonymous memory (heap: main ``RssAnon`` + the workers' ``Private_Dirty``), with the
   memory-mapped Arrow pages (page cache, reclaimable) apart. Per million examples: the marginal
   time between the two sizes (start-up cost removed); memory as the main process's peak plus its
   measured growth per example (the lengths and the plan), plus the workers' measured peak.

Writes ``benchmarks/results/pipeline.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_pack.data import load_lengths
from hybrid_pack.packing import PackedBatchSampler, pack_rollouts, pack_stream, plan_packs
from hybrid_pack.packing.balance import balance_stats

RESULTS = Path(__file__).resolve().parent / "results" / "pipeline.json"
SECTIONS = ("streaming", "balance", "rollouts", "tokenize")
SHAKESPEARE = Path("/work/shared/data/datasets/tinyshakespeare/input.txt.gz")


def bench_streaming(num_examples: int, capacity: int, buffer_size: int, rng: np.random.Generator) -> list[dict]:
    lengths = rng.choice(load_lengths("arena_hard_v2_sky_t1_32b")["full_chatml"], num_examples)
    rows = []
    for overflow in ("truncate", "split"):
        stream = pack_stream(({"input_ids": range(int(n))} for n in lengths), capacity, buffer_size=buffer_size,
                             overflow=overflow)
        start = time.perf_counter()
        for _ in stream:
            pass
        seconds = time.perf_counter() - start
        offline = plan_packs(lengths, capacity, overflow=overflow)
        report = stream.report
        rows.append({"overflow": overflow, "examples": num_examples, "capacity": capacity, "buffer_size": buffer_size,
                     "efficiency": report.efficiency, "packs": report.packs, "offline_efficiency": offline.efficiency,
                     "offline_packs": len(offline), "lower_bound_packs": offline.lower_bound,
                     "num_truncated": report.num_truncated, "num_split": report.num_split,
                     "tokens_truncated": report.tokens_truncated, "max_buffered": report.max_buffered,
                     "seconds": seconds, "examples_per_second": num_examples / seconds})
    return rows


def bench_balance(arena_examples: int, rng: np.random.Generator) -> list[dict]:
    arena = rng.choice(load_lengths("arena_hard_v2_sky_t1_32b")["full_chatml"], arena_examples)
    gsm8k = load_lengths("gsm8k_train")["full_chatml"]
    cases = [("gsm8k_train", gsm8k, 4096, "error"), ("gsm8k_train", gsm8k, 8192, "error"),
             ("arena_resampled", arena, 8192, "split")]
    rows = []
    for name, lengths, capacity, overflow in cases:
        for packs_per_step in (1, 2):
            start = time.perf_counter()
            sampler = PackedBatchSampler(lengths, capacity, num_replicas=8, overflow=overflow,
                                         packs_per_step=packs_per_step)
            build = time.perf_counter() - start
            stats = [sampler.balance(epoch) for epoch in range(3)]
            naive = rng.permutation(sampler.num_packs).reshape(sampler.num_steps, 8, packs_per_step)
            naive_stats = balance_stats(sampler.pack_costs[naive].sum(axis=2))
            rows.append({"dataset": name, "examples": len(lengths), "capacity": capacity,
                         "packs_per_step": packs_per_step, "ranks": 8, "steps": sampler.num_steps,
                         "plan_packs": len(sampler.plan), "sampler_packs": sampler.num_packs,
                         "epoch_max_over_mean": max(s.epoch_max_over_mean for s in stats),
                         "step_max_over_mean": max(s.step_max_over_mean for s in stats),
                         "naive_epoch_max_over_mean": naive_stats.epoch_max_over_mean,
                         "naive_step_max_over_mean": naive_stats.step_max_over_mean,
                         "build_seconds": build})
    return rows


def bench_rollouts(num_rollouts: int, capacity: int, rng: np.random.Generator) -> list[dict]:
    rows = []
    for name in ("arena_hard_v2_sky_t1_32b", "gsm8k_train"):
        table = load_lengths(name)
        pick = rng.integers(0, len(table["full_chatml"]), num_rollouts)
        prompt_lengths, response_lengths = table["last_turn_prompt"][pick], table["last_turn_response"][pick]
        lengths = (prompt_lengths + response_lengths).astype(np.int64)
        plan_packs(lengths, capacity)
        decisions = []
        for _ in range(50):
            start = time.perf_counter()
            plan = plan_packs(lengths, capacity)
            decisions.append(time.perf_counter() - start)
        prompts = [rng.integers(0, 151_643, n).tolist() for n in prompt_lengths]
        responses = [rng.integers(0, 151_643, n).tolist() for n in response_lengths]
        tool_masks = [(rng.random(n) < 0.1).astype(np.int64).tolist() for n in response_lengths]
        advantages = rng.normal(size=num_rollouts).tolist()
        old_logprobs = [(-rng.random(n)).tolist() for n in response_lengths]
        builds = []
        for _ in range(3):
            start = time.perf_counter()
            batches = pack_rollouts(prompts, responses, capacity, tool_masks=tool_masks, advantages=advantages,
                                    old_logprobs=old_logprobs)
            builds.append(time.perf_counter() - start)
        rows.append({"lengths": name, "rollouts": num_rollouts, "capacity": capacity, "packs": len(batches),
                     "tokens": int(lengths.sum()), "efficiency": plan.efficiency,
                     "decision_ms_median": 1e3 * float(np.median(decisions)),
                     "decision_ms_p90": 1e3 * float(np.percentile(decisions, 90)),
                     "build_seconds_median": float(np.median(builds))})
    return rows


def make_synthetic_dataset(path: str, num_examples: int, seed: int) -> None:
    """Child process: write ``num_examples`` synthetic texts to disk as a ``datasets.Dataset``."""
    import datasets

    with gzip.open(SHAKESPEARE, "rt") as f:
        words = np.array(sorted(set(re.findall(r"[A-Za-z']+", f.read()))))

    def rows():
        rng = np.random.default_rng(seed)
        for start in range(0, num_examples, 10_000):
            counts = rng.lognormal(4.0, 0.8, min(10_000, num_examples - start)).astype(np.int64) + 1
            for count in counts:
                yield {"text": " ".join(words[rng.integers(0, len(words), count)])}

    with tempfile.TemporaryDirectory() as cache:
        datasets.Dataset.from_generator(rows, cache_dir=cache).save_to_disk(path)


def _proc_kib(pid: int, filename: str, field: str) -> int:
    """One ``field: N kB`` line of ``/proc/<pid>/<filename>``, in KiB (0 if absent)."""
    with open(f"/proc/{pid}/{filename}") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class MemorySampler(threading.Thread):
    """Samples, every ``interval`` seconds, the anonymous memory of this process and of its workers.

    Memory-mapped Arrow pages are page cache (file-backed, reclaimable) and are reported apart. The
    workers are forked, so their RSS includes pages shared with this process; what each adds is
    its ``Private_Dirty`` memory. ``total anonymous = main RssAnon + sum(worker Private_Dirty)``.
    """

    def __init__(self, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peak_main_anon = self.peak_main_file = self.peak_total_anon = 0
        self.done = threading.Event()

    def run(self) -> None:
        main = psutil.Process()
        while not self.done.is_set():
            workers = 0
            for child in main.children(recursive=True):
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # the worker has exited
                    workers += _proc_kib(child.pid, "smaps_rollup", "Private_Dirty")
            anon = _proc_kib(main.pid, "status", "RssAnon")
            self.peak_main_anon = max(self.peak_main_anon, anon)
            self.peak_main_file = max(self.peak_main_file, _proc_kib(main.pid, "status", "RssFile"))
            self.peak_total_anon = max(self.peak_total_anon, anon + workers)
            time.sleep(self.interval)


def run_tokenize(path: str, num_proc: int, capacity: int) -> dict:
    """Child process: tokenize-and-plan the dataset at ``path``; time and peak memory as JSON."""
    import datasets

    from hybrid_pack.data import load_tokenizer
    from hybrid_pack.packing.hf_datasets import tokenize_and_plan

    datasets.disable_progress_bars()
    dataset = datasets.load_from_disk(path)
    tokenizer = load_tokenizer()
    before = _proc_kib(os.getpid(), "status", "RssAnon")
    sampler = MemorySampler()
    sampler.start()
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        result = tokenize_and_plan(dataset, tokenizer, capacity, num_proc=num_proc if num_proc > 1 else None,
                                   overflow="truncate", cache_file_name=os.path.join(cache, "tokenized.arrow"))
        seconds = time.perf_counter() - start
    sampler.done.set()
    sampler.join()
    return {"examples": len(dataset), "tokens": int(result.lengths.sum()), "seconds": seconds,
            "packs": len(result.plan), "efficiency": result.plan.efficiency, "anon_before_mib": before / 1024,
            "peak_main_anon_mib": sampler.peak_main_anon / 1024, "peak_main_file_mib": sampler.peak_main_file / 1024,
            "peak_total_anon_mib": sampler.peak_total_anon / 1024}


def _tokenize_summary(runs: list[dict]) -> dict:
    """Per-million figures from a small and a large run of one ``num_proc``.

    Time: the marginal rate between the runs (start-up removed). Memory: the main process holds
    O(N) arrays (lengths, plan), so its anonymous peak is extrapolated by its measured growth per
    example; the workers tokenize one batch at a time, so their peak is taken as measured.
    """
    small, large = runs[0], runs[-1]
    extra = large["examples"] - small["examples"]
    seconds = large["seconds"] - small["seconds"]
    main_growth = (large["peak_main_anon_mib"] - small["peak_main_anon_mib"]) / extra
    workers = max(r["peak_total_anon_mib"] - r["peak_main_anon_mib"] for r in runs)
    return {"num_proc": large["num_proc"], "seconds_per_million": seconds / extra * 1e6,
            "tokens_per_second": (large["tokens"] - small["tokens"]) / seconds,
            "main_anon_growth_mib_per_million": main_growth * 1e6, "workers_peak_anon_mib": workers,
            "estimated_peak_anon_mib_at_million": large["peak_main_anon_mib"]
            + max(main_growth, 0.0) * (1e6 - large["examples"]) + workers}


def bench_tokenize(sizes: list[int], num_procs: list[int], capacity: int) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for size in sizes:
            path = os.path.join(folder, f"synthetic_{size}")
            subprocess.run([sys.executable, __file__, "--make-dataset", path, str(size)], check=True)
            for num_proc in num_procs:
                out = subprocess.run([sys.executable, __file__, "--tokenize-child", path, str(num_proc), str(capacity)],
                                     check=False, capture_output=True, text=True,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                if out.returncode:
                    raise RuntimeError(f"tokenize child failed on {size} examples:\n{out.stderr[-3000:]}")
                runs.append({"num_proc": num_proc, **json.loads(out.stdout.strip().splitlines()[-1])})
    return {"capacity": capacity, "runs": runs,
            "per_million": [_tokenize_summary([r for r in runs if r["num_proc"] == n]) for n in num_procs]}


def markdown(results: dict[str, Any]) -> str:
    lines = ["| streaming (BFD, buffer, capacity) | overflow | efficiency | offline plan | packs / lower bound "
             "| examples/s |", "|---|---|---|---|---|---|"]
    for r in results["streaming"]:
        lines.append(f"| {r['examples']:,} arena lengths, {r['buffer_size']:,}, {r['capacity']} | {r['overflow']} | "
                     f"{r['efficiency']:.4%} | {r['offline_efficiency']:.4%} | "
                     f"{r['packs']:,} / {r['lower_bound_packs']:,} | {r['examples_per_second']:,.0f} |")
    lines += ["", ("| balance, 8 ranks | capacity | packs/step | steps | max rank / mean (epoch) "
                   "| slowest / mean (per step) | naive (epoch / step) |"), "|---|---|---|---|---|---|---|"]
    for r in results["balance"]:
        lines.append(f"| {r['dataset']} ({r['examples']:,}) | {r['capacity']} | {r['packs_per_step']} | "
                     f"{r['steps']:,} | {r['epoch_max_over_mean']:.4f} | {r['step_max_over_mean']:.4f} | "
                     f"{r['naive_epoch_max_over_mean']:.4f} / {r['naive_step_max_over_mean']:.4f} |")
    lines += ["", "| pack_rollouts | rollouts | capacity | packs | efficiency | decision median (p90) | full build |",
              "|---|---|---|---|---|---|---|"]
    for r in results["rollouts"]:
        lines.append(f"| {r['lengths']} | {r['rollouts']:,} | {r['capacity']} | {r['packs']} | "
                     f"{r['efficiency']:.2%} | {r['decision_ms_median']:.2f} ms ({r['decision_ms_p90']:.2f} ms) | "
                     f"{r['build_seconds_median']:.2f} s |")
    t = results["tokenize"]
    lines += ["", ("| tokenize_and_plan (Qwen3) | examples | tokens | time | main anon: before / peak | "
                   "peak anon, main + workers | main file-backed (mmap) |"), "|---|---|---|---|---|---|---|"]
    for r in t["runs"]:
        lines.append(f"| num_proc={r['num_proc']} | {r['examples']:,} | {r['tokens']:,} | {r['seconds']:.1f} s | "
                     f"{r['anon_before_mib']:.0f} / {r['peak_main_anon_mib']:.0f} MiB | "
                     f"{r['peak_total_anon_mib']:.0f} MiB | {r['peak_main_file_mib']:.0f} MiB |")
    for m in t["per_million"]:
        lines.append(f"| num_proc={m['num_proc']}, per million | 1,000,000 | | {m['seconds_per_million']:.0f} s "
                     f"({m['tokens_per_second']:,.0f} tokens/s) | "
                     f"main {m['main_anon_growth_mib_per_million']:+.0f} MiB per million | "
                     f"{m['estimated_peak_anon_mib_at_million']:.0f} MiB (estimate) | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--num-procs", type=int, nargs="+", default=[1, 2],
                        help="Dataset.map workers for tokenize_and_plan (1: no worker processes)")
    parser.add_argument("--tokenize-sizes", type=int, nargs=2, default=[20_000, 200_000])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS),
                        help="run only these (the others keep their values in the results file)")
    parser.add_argument("--make-dataset", nargs=2, metavar=("PATH", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--tokenize-child", nargs=3, metavar=("PATH", "NUM_PROC", "CAPACITY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_dataset:
        make_synthetic_dataset(args.make_dataset[0], int(args.make_dataset[1]), seed=0)
        return
    if args.tokenize_child:
        path, num_proc, capacity = args.tokenize_child
        print(json.dumps(run_tokenize(path, int(num_proc), int(capacity))))
        return

    scale = 10 if args.quick else 1
    runners = {
        "streaming": lambda rng: bench_streaming(200_000 // scale, 8192, 10_000, rng),
        "balance": lambda rng: bench_balance(200_000 // scale, rng),
        "rollouts": lambda rng: bench_rollouts(4096, 16384, rng),
        "tokenize": lambda rng: bench_tokenize([s // scale for s in args.tokenize_sizes], args.num_procs, 4096),
    }
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() and not args.quick else {}
    results["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
    for name in args.sections:
        results[name] = runners[name](np.random.default_rng(0))
    if not args.quick:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=2))
        print(f"wrote {RESULTS}")
    print(markdown(results))


if __name__ == "__main__":
    main()
