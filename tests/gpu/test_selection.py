"""Backend selection on CUDA never crashes: whatever kernels are installed, ``report``, ``verify``, the
CLI and the ops fall back to a backend that passed its check, and say which runs and why."""

from __future__ import annotations

import pytest
import torch

from hybrid_pack import backends
from hybrid_pack.cli import main


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_report_names_a_checked_backend_for_every_op(dtype: torch.dtype, cuda: torch.device) -> None:
    text = backends.report(cuda, dtype)
    chosen = [line.split()[:2] for line in text.splitlines() if "CHOSEN" in line]
    assert [op for op, _ in chosen] == list(backends.OPS), text


def test_verify_checks_every_backend_that_can_run(cuda: torch.device, capsys: pytest.CaptureFixture[str]) -> None:
    results = backends.verify(device=cuda)
    for r in results:
        print(f"{r.op:<12} {r.backend:<14} {r.dtype:<9} {'ok' if r.ok else 'FAILED'} {r.max_error:.1e} "
              f"{r.seconds:.2f}s {r.reason}")
    assert all(r.ok for r in results if r.backend == "torch")
    assert all(r.reason for r in results if not r.ok)


def test_cli_commands_do_not_crash_on_a_backend(cuda: torch.device) -> None:
    assert main(["backends", "--verify", "--device", "cuda"]) in (0, 1)
    assert main(["check", "qwen3-next-tiny", "--device", "cuda", "--dtype", "bfloat16"]) == 0
