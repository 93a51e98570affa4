"""A real two-process torchrun (gloo, CPU) run of PackedBatchSampler + PackingCollator + DDP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dist_sampler_worker.py")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_two_process_torchrun_sees_every_example_once(tmp_path):
    out = tmp_path / "gathered.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(WORKER), str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    record = json.loads(out.read_text())
    ranks = record["ranks"]
    assert record["world_size"] == 2 and len(ranks) == 2
    assert ranks[0]["len"] == ranks[1]["len"] > 0
    for epoch in range(2):
        steps = [r["epochs"][epoch] for r in ranks]
        assert len(steps[0]) == len(steps[1]) == ranks[0]["len"]
        seen = Counter(i for rank_steps in steps for batch in rank_steps for i in batch)
        assert seen == Counter(range(record["num_examples"]))
        assert not set(i for b in steps[0] for i in b) & set(i for b in steps[1] for i in b)
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]
    assert all(r["resumed_matches"] and r["losses_finite"] for r in ranks)
