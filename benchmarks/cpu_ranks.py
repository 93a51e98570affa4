"""What the context-parallel CPU benchmarks share: the benchmark script launched again as gloo ranks (one torch
thread each), forward + backward timed in process CPU seconds, and the result file and markdown table they end with.

Process CPU time, not wall time: the ranks share a small machine with other work, so wall time would measure the
scheduler; a rank's CPU time is the work one device would do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch


def arguments(doc: str, results: Path, repeats: int) -> argparse.ArgumentParser:
    """A benchmark's parser: ``doc`` as its help, ``--out`` (default ``results``), ``--repeats`` for
    :func:`cpu_seconds` (default ``repeats``) and the hidden ``--worker PART`` that :func:`run_ranks` launches each
    rank with."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=results)
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    return parser


def run_ranks(script: str, ranks: int, out: Path, *args: str) -> list[dict]:
    """Run ``script --worker PART *args`` on ``ranks`` gloo processes (``torch.distributed.run``, one OpenMP thread
    each) and return the rows one rank wrote to ``PART`` as a JSON list; ``PART`` sits beside ``out`` and is removed.
    """
    part = out.with_suffix(f".{ranks}.part")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                    script, "--worker", str(part), *args], check=True, env=env)
    rows = json.loads(part.read_text())
    part.unlink()
    return rows


def cpu_seconds(step: Callable[[dict[str, torch.Tensor]], torch.Tensor], inputs: dict[str, torch.Tensor],
                weight: torch.Tensor, repeats: int) -> float:
    """Best process CPU time of forward + backward of ``sum(step(leaves) * weight)`` over ``repeats`` runs after one
    warm-up; ``leaves`` are fresh detached copies of ``inputs`` that require grad."""
    best = float("inf")
    for attempt in range(repeats + 1):
        leaves = {name: x.detach().requires_grad_() for name, x in inputs.items()}
        start = time.process_time()
        (step(leaves) * weight).sum().backward()
        if attempt:
            best = min(best, time.process_time() - start)
    return best


def write_result(out: Path, benchmark: str, rows: list[dict], **setup: object) -> None:
    """Write ``{"benchmark", "command", **setup, "threads_per_rank", "torch", "machine", "cpu_count", "rows"}`` to
    ``out`` as JSON; ``command`` is how this script was run."""
    result = {"benchmark": benchmark,
              "command": " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]), **setup,
              "threads_per_rank": 1, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
              "cpu_count": os.cpu_count(), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def print_table(header: Sequence[str], lines: Iterable[Sequence[object]]) -> None:
    """Print a markdown table: the first column left-aligned, the others (numbers) right-aligned."""
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    for line in lines:
        print("| " + " | ".join(map(str, line)) + " |")
