"""What the runtime guard costs on a sharded model: FSDP2 against plain DDP, two gloo ranks on CPU.

    python benchmarks/bench_guard_fsdp.py [--steps 8] [--capacity 1024]

Launches itself on two ranks (``torch.distributed.run``). Each rank trains ``qwen3-next-tiny`` on its own GSM8K
packed rows, once sharded with FSDP2 (``apply_fsdp``) and once replicated with DDP, with the guard attached
and checking every call (``every=1``), so every step holds one check. A step's time is the slowest rank's;
a check's is the time the hook spends in it on the slowest rank (under FSDP2 its forwards all-gather
parameters, and both ranks wait for the one with the longer documents). The check's share of the step
without it, over N, is the overhead at ``every=N``; ``DEFAULT_GUARD_EVERY`` is the default. Writes
benchmarks/results/guard_fsdp.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybrid_pack import PackedBatchSampler, PackedBoundaries, PackingCollator
from hybrid_pack.modeling import from_preset
from hybrid_pack.parallel.fsdp import apply_fsdp
from hybrid_pack.schema import BOUNDARIES, INPUT_IDS, LABELS
from hybrid_pack.testing import PackingGuard
from hybrid_pack.training import DEFAULT_GUARD_EVERY
from hybrid_pack.training.data import build_features, load_chats

RESULTS = Path(__file__).parent / "results" / "guard_fsdp.json"
PRESET = "qwen3-next-tiny"
RANKS = 2
WARMUP_STEPS = 2


def _rows(vocab_size: int, capacity: int, steps: int, rank: int) -> list[dict[str, Any]]:
    """This rank's first ``steps`` packed rows of GSM8K."""
    features, _ = build_features(load_chats("gsm8k", RANKS * steps * capacity // 120 + 16), vocab_size,
                                 max_length=capacity)
    sampler = PackedBatchSampler([len(f[INPUT_IDS]) for f in features], capacity, num_replicas=RANKS, rank=rank)
    collator = PackingCollator()
    rows = []
    for indices, _ in zip(sampler, range(steps), strict=False):
        batch = collator([features[i] for i in indices])
        rows.append({INPUT_IDS: batch[INPUT_IDS], LABELS: batch[LABELS],
                     BOUNDARIES: PackedBoundaries.from_batch(batch)})
    return rows


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def measure(mode: str, steps: int, capacity: int) -> dict[str, Any]:
    """Time ``steps`` training steps of one mode (``fsdp`` or ``ddp``), each with one guard check."""
    torch.manual_seed(0)
    model = from_preset(PRESET)
    if mode == "fsdp":
        trained = apply_fsdp(model, torch.distributed.device_mesh.init_device_mesh("cpu", (RANKS,)))
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-4)
    guard = PackingGuard(trained, every=1).attach()
    steps_s, checks_s, documents = [], [], []
    for step, row in enumerate(_rows(model.config.vocab_size, capacity, steps + WARMUP_STEPS, dist.get_rank())):
        dist.barrier()
        began = time.perf_counter()
        trained(**row).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_seconds = _slowest(time.perf_counter() - began)
        check_seconds = _slowest(guard.records[-1].seconds)
        if step >= WARMUP_STEPS:
            steps_s.append(step_seconds - check_seconds)
            checks_s.append(check_seconds)
            documents.append(len(guard.records[-1].documents))
    guard.detach()
    shares = sorted(c / s for c, s in zip(checks_s, steps_s, strict=True))
    share = statistics.median(shares)
    return {"mode": mode, "steps_timed": len(steps_s), "all_checks_ok": all(r.ok for r in guard.records),
            "group": "FSDP2 mesh" if mode == "fsdp" else "DDP process group",
            "step_seconds_without_check": {"min": min(steps_s), "median": statistics.median(steps_s)},
            "check_seconds": {"min": min(checks_s), "median": statistics.median(checks_s)},
            "documents_per_check": {"min": min(documents), "max": max(documents)},
            "check_share_of_step": {"median": share, "max": shares[-1]},
            "overhead_at_default_every": share / DEFAULT_GUARD_EVERY,
            "worst_overhead_at_default_every": shares[-1] / DEFAULT_GUARD_EVERY}


def worker(steps: int, capacity: int) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    modes = [measure(mode, steps, capacity) for mode in ("ddp", "fsdp")]
    if dist.get_rank() == 0:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps({
            "preset": PRESET, "capacity": capacity, "ranks": RANKS, "backend": "gloo", "torch_threads_per_rank": 1,
            "default_every": DEFAULT_GUARD_EVERY, "load_average": [load_before, os.getloadavg()[0]],
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "modes": modes,
        }, indent=1))
        for row in modes:
            print(f"{row['mode']:>4}: step {row['step_seconds_without_check']['median']:.3f} s, check "
                  f"{row['check_seconds']['median']:.3f} s ({row['check_share_of_step']['median']:.1%} of its step); "
                  f"overhead at every={DEFAULT_GUARD_EVERY}: {row['overhead_at_default_every']:.3%}")
        print(f"wrote {RESULTS}")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode (after 2 warm-up steps)")
    parser.add_argument("--capacity", type=int, default=1024, help="tokens per packed row")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args.steps, args.capacity)
        return
    path = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
                    __file__, "--steps", str(args.steps), "--capacity", str(args.capacity)], check=True, env=env)


if __name__ == "__main__":
    main()
