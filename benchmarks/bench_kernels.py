"""Boundary cost and adapter overhead of every backend of every op, forward + backward.

    python benchmarks/bench_kernels.py [--device cuda] [--dtype bfloat16] [--tokens 32768] [--repeats 20]

Per op and backend: one document of T tokens against a mixed packed row and a row of documents under
64 tokens (boundary cost, target <= 5%), and the public op against the library's kernel called directly
(adapter overhead, target <= 2%). Writes benchmarks/results/kernels_<device>.json with the device and
every version, and prints a markdown table for docs/benchmarks.md. Same as ``hybrid-pack bench --device``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hybrid_pack.bench.kernels import run_kernel_benchmarks
from hybrid_pack.bench.report import kernel_table
from hybrid_pack.ops.dispatch.verdicts import device_name, environment

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per row (default: 32768 on CUDA, 8192 on CPU)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokens = args.tokens or (32_768 if device.type == "cuda" else 8192)
    results = run_kernel_benchmarks(device, dtype, tokens, args.repeats)
    out = RESULTS / f"kernels_{device.type}.json"
    out.write_text(json.dumps({"device": device_name(device), "environment": environment(), "tokens": tokens,
                               "results": [r.to_dict() for r in results]}, indent=1))
    print(kernel_table(results))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
