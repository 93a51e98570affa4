"""Launch a worker of tests/workers/ under ``torch.distributed.run`` (gloo on CPU) and fail with its output; inside
a worker, run its cases on every rank and write what they found; and end a worker once its group has ended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

WORKERS = Path(__file__).parent


def torchrun(script: str | Path, *args: str, processes: int = 2,
             timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``WORKERS / script`` on ``processes`` ranks; assert that every rank exited 0 within ``timeout`` s, and
    return the launch (its ``stdout`` and ``stderr``).

    Each rank has one torch thread, gloo over loopback, and this checkout first on its path (workers import its
    ``hybrid_pack`` and ``tests``).
    """
    path = os.pathsep.join(filter(None, [str(WORKERS.parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": path}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(WORKERS / script), *args]
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def launch_once(script: str | Path, directory: Callable[[str], Path], *, timeout: float = 600
                ) -> Callable[[int], dict[str, str]]:
    """``of(world)``: the verdicts ``script`` writes when launched on ``world`` ranks, launched on first use only
    (``directory(name)`` makes a fresh folder for the launch's JSON, e.g. ``tmp_path_factory.mktemp``)."""
    launched: dict[int, dict[str, str]] = {}

    def of(world: int) -> dict[str, str]:
        if world not in launched:
            out = directory(f"{Path(script).stem}{world}") / "verdicts.json"
            torchrun(script, str(out), processes=world, timeout=timeout)
            launched[world] = json.loads(out.read_text())
        return launched[world]

    return of


def run_cases(cases: Mapping[str, Callable[[int], object]]) -> dict[str, str]:
    """Run ``case(rank)`` for every case, in order, on every rank of the default group; return ``{case: verdict}``.

    A verdict is ``"ok"`` where the case returned on every rank, else the first failing rank's error with the last
    three frames of its traceback (every rank returns the same verdicts). Each case's name, and a failure, goes to
    stderr as it happens: the output of a launch that hangs shows where.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    verdicts = {}
    for name, case in cases.items():
        print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
        try:
            case(rank)
            verdict = "ok"
        except Exception as error:  # every failure becomes the case's verdict
            verdict = f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc(limit=-3)}"
            print(verdict, file=sys.stderr, flush=True)
        every = [None] * world
        dist.all_gather_object(every, verdict)
        verdicts[name] = next((v for v in every if v != "ok"), "ok")
    return verdicts


def write_on_rank0(path: str | Path, value: object) -> None:
    """Rank 0 writes ``value`` as JSON (indent 1) to ``path``, what a worker's test reads; other ranks write nothing."""
    if dist.get_rank() == 0:
        Path(path).write_text(json.dumps(value, indent=1))


def exit_without_finalizing(code: int) -> NoReturn:
    """End this worker with ``code`` now, output flushed, skipping the interpreter's finalization.

    For a worker that used gloo, after :func:`hybrid_pack.distributed.end_process_group`: gloo's worker threads
    can still hold tensors when the interpreter finalizes, and freeing them then aborts the process ("terminate
    called without an active exception"; pytorch/pytorch#179291 describes it), turning a passed check into a
    failed one.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
