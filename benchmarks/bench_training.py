"""Packed against padded training throughput of the tiny presets on bundled GSM8K (capacity 2048).

    python benchmarks/bench_training.py [--steps 30] [--device cpu]

Writes benchmarks/results/training.json. Target: packed real tokens/s / padded real tokens/s >=
0.9 x (padded tokens / real tokens). Same as ``hybrid-pack bench --model NAME``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybrid_pack.training.benchmark import run_benchmark

RESULTS = Path(__file__).parent / "results" / "training.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    rows = [run_benchmark(model=name, steps=args.steps, device=args.device)
            for name in ("qwen3-next-tiny", "bamba-tiny")]
    RESULTS.write_text(json.dumps(rows, indent=1))
    print("| model | device | packed tok/s | padded tok/s | padded/real | speed-up | target | losses agree |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['device']} | {r['packed_tokens_per_second']:,.0f} | "
              f"{r['padded_tokens_per_second']:,.0f} | {r['padded_tokens_per_real_token']:.2f} | "
              f"{r['speedup']:.2f}x | {r['target_speedup']:.2f}x | {r['losses_agree']} |")


if __name__ == "__main__":
    main()
