"""Whole-step time of a packed training step on CPU: forward + backward + optimizer step of the native
``qwen3-next-tiny`` and ``bamba-tiny`` presets on one packed row of GSM8K-like lengths (collator output, as the
built-in loop feeds it), median of 8 steps after 2 warm-up steps, one thread.

Run from the repository root: ``python benchmarks/bench_step_time.py [--label NAME]``; appends to
benchmarks/results/step_time.json under NAME (default: the current commit). docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from hybrid_pack import PackingCollator
from hybrid_pack.modeling import from_preset

RESULTS = Path(__file__).parent / "results" / "step_time.json"
LENGTHS = [180, 95, 240, 60, 130, 210, 75, 150, 33, 120, 200, 90, 170, 45]   # 1,798 tokens in one row


def step_seconds(preset: str, steps: int = 8, warmup: int = 2) -> float:
    torch.manual_seed(0)
    model = from_preset(preset).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    examples = [{"input_ids": torch.randint(3, vocab, (n,)).tolist()} for n in LENGTHS]
    batch = PackingCollator()(examples)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default=None)
    args = parser.parse_args()
    label = args.label or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                         text=True).stdout.strip()
    torch.set_num_threads(1)
    figures = {preset: round(step_seconds(preset) * 1e3, 2) for preset in ("qwen3-next-tiny", "bamba-tiny")}
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results[label] = {"median_step_ms": figures, "tokens": sum(LENGTHS), "torch": torch.__version__}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(label, figures)


if __name__ == "__main__":
    main()
