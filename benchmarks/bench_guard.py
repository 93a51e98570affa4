"""What the runtime leak guard costs: one check against one packed training step, and the hook on the other calls.

    python benchmarks/bench_guard.py [--steps 30] [--capacity 2048] [--threads 1 2]

For each preset, the native trainer's step (forward with ``boundaries=``, backward, clipping, AdamW) runs on
GSM8K packed rows; between its forward and its backward, ``PackingGuard.check`` runs on the step's batch and
logits, which is the work the attached guard does on a checked call. Step and check are timed back to back (wall and CPU
time), so each pair shares the machine's load; the cost of a check is given as a share of its own step.
With checks on calls 0, N, 2N, ... the overhead at N is that share / N, plus the hook's cost on the calls
it does not check (timed on a module that does nothing else). Writes benchmarks/results/guard.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from hybrid_pack import PackedBatchSampler, PackedBoundaries, PackingCollator
from hybrid_pack.modeling import from_preset
from hybrid_pack.schema import BOUNDARIES, INPUT_IDS, LABELS, NUM_ITEMS_IN_BATCH
from hybrid_pack.testing import PackingGuard
from hybrid_pack.training import DEFAULT_GUARD_EVERY
from hybrid_pack.training.data import build_features, load_chats
from hybrid_pack.training.loop import count_targets

RESULTS = Path(__file__).parent / "results" / "guard.json"
PRESETS = ("qwen3-next-tiny", "bamba-tiny")
EVERY = (1, 10, 20, 50, 100, 200)
WARMUP_STEPS = 2


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``, its wall seconds and its CPU seconds (every thread of the process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _packed_batches(vocab_size: int, capacity: int, steps: int) -> Iterator[dict[str, Any]]:
    features, _ = build_features(load_chats("gsm8k", steps * capacity // 120 + 16), vocab_size, max_length=capacity)
    sampler = PackedBatchSampler([len(f[INPUT_IDS]) for f in features], capacity, seed=0)
    collator = PackingCollator()
    for indices, _ in zip(sampler, range(steps)):
        yield collator([features[i] for i in indices])


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def measure_preset(preset: str, steps: int, capacity: int) -> dict[str, Any]:
    """Time ``steps`` training steps of ``preset``, each followed by the guard's check of its batch."""
    torch.manual_seed(0)
    model = from_preset(preset).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = PackingGuard(model)
    rows = []
    for step, batch in enumerate(_packed_batches(model.config.vocab_size, capacity, steps + WARMUP_STEPS)):
        call = {INPUT_IDS: batch[INPUT_IDS], LABELS: batch[LABELS], BOUNDARIES: PackedBoundaries.from_batch(batch),
                NUM_ITEMS_IN_BATCH: torch.tensor(count_targets(batch[LABELS]))}

        def backward_and_step(out: Any) -> None:
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        out, forward_wall, forward_cpu = _timed(lambda call=call: model(**call))
        record, check_wall, check_cpu = _timed(lambda call=call, out=out, step=step: guard.check(
            call, out.logits.detach(), step=step))                  # before the weights change, as the hook does
        _, rest_wall, rest_cpu = _timed(lambda out=out: backward_and_step(out))
        step_wall, step_cpu = forward_wall + rest_wall, forward_cpu + rest_cpu
        if step >= WARMUP_STEPS:
            rows.append({"step_wall": step_wall, "step_cpu": step_cpu, "check_wall": check_wall,
                         "check_cpu": check_cpu, "checked_tokens": sum(record.lengths), "ok": record.ok})
    share_wall = [r["check_wall"] / r["step_wall"] for r in rows]
    share_cpu = [r["check_cpu"] / r["step_cpu"] for r in rows]
    return {
        "preset": preset, "capacity": capacity, "steps_timed": len(rows), "all_checks_ok": all(r["ok"] for r in rows),
        "step_seconds": _stats([r["step_wall"] for r in rows]),
        "step_cpu_seconds": _stats([r["step_cpu"] for r in rows]),
        "check_seconds": _stats([r["check_wall"] for r in rows]),
        "check_cpu_seconds": _stats([r["check_cpu"] for r in rows]),
        "checked_tokens_per_check": _stats([r["checked_tokens"] for r in rows]),
        "check_share_of_step": {"wall": _stats(share_wall), "cpu": _stats(share_cpu)},
    }


def hook_seconds_per_call(calls: int = 20_000) -> float:
    """Extra seconds per call that the attached guard adds to a packed call it does not check."""

    class Noop(torch.nn.Module):
        def forward(self, **batch: Any) -> torch.Tensor:
            return batch[INPUT_IDS]

    module, batch = Noop().train(), PackingCollator()([{INPUT_IDS: list(range(1, 9))}] * 4)

    def run() -> float:
        began = time.perf_counter()
        for _ in range(calls):
            module(**batch)
        return time.perf_counter() - began

    bare = min(run() for _ in range(3))
    guard = PackingGuard(module, every=10 ** 9).attach()
    guard.calls = 1                                           # never due
    hooked = min(run() for _ in range(3))
    guard.detach()
    return max(0.0, hooked - bare) / calls


def run(threads: int, steps: int, capacity: int) -> dict[str, Any]:
    """Every preset at ``threads`` torch threads, with the overhead at each N of ``EVERY``."""
    torch.set_num_threads(threads)
    load_before = os.getloadavg()[0]
    hook = hook_seconds_per_call()
    presets = [measure_preset(name, steps, capacity) for name in PRESETS]
    for row in presets:
        step = row["step_seconds"]["median"]
        row["overhead_by_every"] = {
            str(n): {kind: row["check_share_of_step"][kind]["median"] / n + hook / step for kind in ("wall", "cpu")}
            for n in EVERY}
        row["worst_overhead_by_every"] = {str(n): row["check_share_of_step"]["wall"]["max"] / n for n in EVERY}
        row["overhead_at_default_every"] = row["overhead_by_every"][str(DEFAULT_GUARD_EVERY)]
    return {"threads": threads, "load_average": [load_before, os.getloadavg()[0]],
            "hook_seconds_per_unchecked_call": hook, "presets": presets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per preset (after 2 warm-up steps)")
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads, one run each")
    args = parser.parse_args()
    runs = [run(threads, args.steps, args.capacity) for threads in args.threads]
    results = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()},
               "capacity": args.capacity, "default_every": DEFAULT_GUARD_EVERY, "documents_per_check": 3,
               "runs": runs}
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"| preset | threads | step s (min / median) | check s (min / median) | check / step (median, max) | "
          f"overhead at N={DEFAULT_GUARD_EVERY} (median, worst step) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in runs:
        for p in r["presets"]:
            s, c, share = p["step_seconds"], p["check_seconds"], p["check_share_of_step"]["wall"]
            worst = p["worst_overhead_by_every"][str(DEFAULT_GUARD_EVERY)]
            print(f"| {p['preset']} | {r['threads']} | {s['min']:.3f} / {s['median']:.3f} | "
                  f"{c['min']:.3f} / {c['median']:.3f} | {100 * share['median']:.1f}%, {100 * share['max']:.1f}% | "
                  f"{100 * p['overhead_at_default_every']['wall']:.2f}%, {100 * worst:.2f}% |")
        hook_us = r["hook_seconds_per_unchecked_call"] * 1e6
        print(f"hook on an unchecked call ({r['threads']} threads): {hook_us:.1f} us")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
