"""Launch a worker of tests/workers/ under ``torch.distributed.run`` (gloo on CPU) and fail with its output; and
end a worker once its group has ended."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

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
