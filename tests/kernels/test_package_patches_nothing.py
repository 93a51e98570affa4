"""The package itself patches neither Triton nor ``sys.modules``: that is this tier's own set-up
(``tests/kernels/triton_cpu.py``). In a fresh process that allows Triton's interpreter but patches nothing,
the ``mamba_ssm`` backend says mamba-ssm does not import without its CUDA extension, and nothing stands in for
that extension."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.kernels.triton_cpu import CUDA_EXTENSIONS

pytestmark = pytest.mark.kernels

FRESH_PROCESS = """
import json, sys
import torch
from triton.runtime.autotuner import Autotuner
from hybrid_pack.backends import available, get_backend
from hybrid_pack.ops.triton_device import mark_cpu_interpreter_ready

autotuner_timing = Autotuner.__dict__["do_bench"]
mark_cpu_interpreter_ready()
reason = get_backend("ssd", "mamba_ssm").reason(torch.device("cpu"), torch.float32, False)
listed = {(r.op, r.backend): r.usable for op in ("conv", "gated_delta", "ssd") for r in available(op)}
print(json.dumps({"reason": reason, "stood_in": [name for name in EXTENSIONS if name in sys.modules],
                  "autotuner_patched": Autotuner.__dict__["do_bench"] is not autotuner_timing,
                  "mamba_ssm_usable": listed[("ssd", "mamba_ssm")]}))
"""


def test_selecting_backends_stubs_no_extension_and_patches_no_triton() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    program = f"EXTENSIONS = {list(CUDA_EXTENSIONS)!r}\n{FRESH_PROCESS}"
    result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    assert seen["reason"].startswith("mamba-ssm does not import") and "selective_scan_cuda" in seen["reason"]
    assert seen["stood_in"] == [] and not seen["autotuner_patched"] and not seen["mamba_ssm_usable"]
