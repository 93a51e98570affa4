"""Peak memory of the pure-torch selective scan's forward + backward, before and after the chunked rewrite.

One document of ``T`` tokens, ``D`` channels, ``N`` states, float32 on CPU. Each measurement runs in a fresh
subprocess and reports its peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) minus the RSS
just before the scan, with the inputs already allocated: the memory the scan's forward and backward add (outputs
and gradients included). The old implementation is ``git show 574d429:hybrid_pack/ops/selective_scan/torch_backend.py``
(the last commit before the chunked scan)
written to a temporary module at run time (never into the repository); it holds ``[T, D, N]`` tensors, so where
it would not fit in ``--old-budget-gb`` it is measured at shorter ``T`` and extrapolated linearly in ``T``.

    python benchmarks/bench_selective_scan_memory.py [--tokens 8192] [--channels 2048] [--states 16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "selective_scan_memory.json"
OLD_PATH = "hybrid_pack/ops/selective_scan/torch_backend.py"
OLD_COMMIT = "574d429"   # the last commit with the unchunked scan


def _measure(implementation: str, old_module: str, tokens: int, channels: int, states: int) -> dict:
    """In this (child) process: inputs, then one forward + backward; the RSS the scan added, in MiB."""
    import importlib.util
    import time

    import torch

    from hybrid_pack import PackedBoundaries

    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, channels, generator=generator).requires_grad_()
    dt = (torch.rand(tokens, channels, generator=generator) * 0.1).requires_grad_()
    A = (-torch.rand(channels, states, generator=generator) - 0.5).requires_grad_()
    B = torch.randn(tokens, states, generator=generator).requires_grad_()
    C = torch.randn(tokens, states, generator=generator).requires_grad_()
    boundaries = PackedBoundaries.from_lengths([tokens])
    if implementation == "old":
        spec = importlib.util.spec_from_file_location("old_selective_scan", old_module)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        run = lambda: module.scan(x, dt, A, B, C, boundaries)  # noqa: E731
    else:
        from hybrid_pack.ops.selective_scan import torch_backend
        run = lambda: torch_backend.scan(x, dt, A, B, C, boundaries)[0]  # noqa: E731
    before = _rss_now()
    start = time.perf_counter()
    run().sum().backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"implementation": implementation, "tokens": tokens, "channels": channels, "states": states,
            "peak_added_mib": round(peak - before, 1), "seconds": round(seconds, 2)}


def _rss_now() -> float:
    """Current resident set size in MiB (/proc/self/statm)."""
    import os

    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _run_child(implementation: str, old_module: str, tokens: int, channels: int, states: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", implementation, old_module, str(tokens),
                          str(channels), str(states)], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--channels", type=int, default=2048)
    parser.add_argument("--states", type=int, default=16)
    parser.add_argument("--old-budget-gb", type=float, default=24.0)
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        implementation, old_module, *sizes = args.child
        print(json.dumps(_measure(implementation, old_module, *map(int, sizes))))
        return

    with tempfile.TemporaryDirectory() as folder:
        old_module = str(Path(folder) / "old_selective_scan.py")
        source = subprocess.run(["git", "show", f"{OLD_COMMIT}:{OLD_PATH}"], capture_output=True, text=True, check=True,
                                cwd=ROOT).stdout
        Path(old_module).write_text(source)
        sizes = (args.channels, args.states)
        new = _run_child("new", old_module, args.tokens, *sizes)
        # The old scan keeps about 6 float32 [T, D, N] tensors (decay, inputs, every step's state and the grads).
        old_estimate_gb = 6 * 4 * args.tokens * args.channels * args.states / 2**30
        if old_estimate_gb <= args.old_budget_gb:
            old = [_run_child("old", old_module, args.tokens, *sizes)]
            extrapolated = None
        else:
            old = [_run_child("old", old_module, t, *sizes) for t in (args.tokens // 16, args.tokens // 8)]
            slope = (old[1]["peak_added_mib"] - old[0]["peak_added_mib"]) / (old[1]["tokens"] - old[0]["tokens"])
            extrapolated = round(old[1]["peak_added_mib"] + slope * (args.tokens - old[1]["tokens"]), 1)
    result = {
        "measure": "peak RSS of a fresh subprocess (ru_maxrss) minus its RSS before the scan, inputs allocated; "
                   "forward + backward of one document, float32, CPU, 1 thread",
        "new": new, "old": old,
        "old_extrapolated_peak_added_mib_at_tokens": extrapolated,
        "old_budget_gb_exceeded": None if extrapolated is None else args.old_budget_gb,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
