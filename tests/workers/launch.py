"""Launch a worker of tests/workers/ under ``torch.distributed.run`` (gloo on CPU) and fail with its output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent


def torchrun(script: str | Path, *args: str, processes: int = 2, timeout: float = 300) -> None:
    """Run ``WORKERS / script`` on ``processes`` ranks; assert that every rank exited 0 within ``timeout`` s.

    Each rank has one torch thread, gloo over loopback, and this checkout first on its path (workers import its
    ``hybrid_pack`` and ``tests``).
    """
    path = os.pathsep.join(filter(None, [str(WORKERS.parents[1]), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": path}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               str(WORKERS / script), *args]
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
