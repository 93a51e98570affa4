"""Checkpoints survive a kill at any moment and load nothing but tensors and plain values.

A run killed with SIGKILL inside a save (tests/workers/killed_save.py) resumes from the last complete step folder
and ends bit for bit where the uninterrupted run ends; a checkpoint file holding a pickle payload is refused with an
error naming it, and the payload never runs. Both for one process and for ``--fsdp`` on two gloo ranks.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from hybrid_pack.errors import InputError
from hybrid_pack.training import TrainConfig, train
from hybrid_pack.training.checkpoint import (
    CHECKPOINT,
    POINTER,
    STATE_FILE,
    agreed_checkpoint,
    latest_checkpoint,
    read_state,
)
from hybrid_pack.training.dcp_reader import read_dcp, read_dcp_metadata
from tests.workers.killed_save import KILLED_STEP, MOMENTS, SETTINGS
from tests.workers.launch import WORKERS
from tests.workers.sharded_resume import PLANTED, Payload

REPO = WORKERS.parents[1]
RESUMED_FROM = {"writing": "step-000004", "pointing": "step-000004", "pruning": f"step-{KILLED_STEP:06d}"}
"""The step folder each kill leaves ``latest`` naming: the save in progress counts once ``latest`` names it."""
LEFT_BY_KILL = {"writing": f"step-{KILLED_STEP:06d}.tmp", "pointing": f"step-{KILLED_STEP:06d}",
                "pruning": "step-000002.old"}
FINAL_FOLDERS = [POINTER, "step-000006", "step-000008"]
"""What the root holds after the last save of eight steps: the last two step folders and the pointer."""


def _worker_env() -> dict[str, str]:
    """This checkout first on the path, and one torch thread as in this process (tests/conftest.py): the same
    arithmetic, so the same bits."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def _folders(run: Path) -> list[str]:
    return sorted(path.name for path in (run / CHECKPOINT).iterdir())


def _final_parameters(run: Path) -> dict[str, torch.Tensor]:
    return read_state(latest_checkpoint(run / CHECKPOINT) / STATE_FILE)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("full")
    return out, train(TrainConfig(out=str(out), **SETTINGS))


# ------------------------------------------------------------------------------- choosing the folder to load
def _complete(root: Path, *names: str) -> None:
    for name in names:
        (root / name).mkdir(parents=True)


def test_the_pointer_decides_and_without_it_the_newest_complete_folder(tmp_path):
    root = tmp_path / CHECKPOINT
    _complete(root, "step-000002", "step-000004", "step-000006.tmp", "step-000008.old", "step-9")
    assert latest_checkpoint(root) == root / "step-000004"  # no pointer: staging and half-removed folders ignored
    (root / POINTER).write_text("step-000002\n")
    assert latest_checkpoint(root) == root / "step-000002"
    _complete(tmp_path, "elsewhere/step-000002")
    for pointed in ("step-000010", "../elsewhere/step-000002"):  # a folder that is not there, or not in the root
        (root / POINTER).write_text(pointed)
        assert latest_checkpoint(root) == root / "step-000004"
    assert agreed_checkpoint(root) == root / "step-000004"  # and it cleans what killed saves left
    assert _folders(tmp_path) == [POINTER, "step-000002", "step-000004", "step-9"]


def test_nothing_to_resume_is_an_input_error(tmp_path):
    _complete(tmp_path / CHECKPOINT, "step-000002.tmp")
    with pytest.raises(InputError, match="no complete checkpoint"):
        agreed_checkpoint(tmp_path / CHECKPOINT)


@pytest.mark.parametrize("old", ["checkpoint.pt", f"{CHECKPOINT}/.metadata"])
def test_a_checkpoint_of_the_earlier_layout_says_how_to_move_it(tmp_path, old):
    (tmp_path / old).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / old).write_bytes(b"")
    with pytest.raises(InputError, match=r"earlier layout.*move .*step-000000"):
        latest_checkpoint(tmp_path / CHECKPOINT)


# ----------------------------------------------------------------------------------------- a kill in a save
@pytest.mark.parametrize("moment", MOMENTS)
def test_a_run_killed_inside_a_save_resumes_to_the_same_bits(tmp_path, uninterrupted, moment):
    full, expected = uninterrupted
    killed = subprocess.run([sys.executable, str(WORKERS / "killed_save.py"), str(tmp_path), moment],
                            env=_worker_env(), cwd=REPO, capture_output=True, text=True, timeout=240)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert LEFT_BY_KILL[moment] in _folders(tmp_path)
    assert latest_checkpoint(tmp_path / CHECKPOINT).name == RESUMED_FROM[moment]

    resumed = train(TrainConfig(out=str(tmp_path), resume=True, **SETTINGS))
    assert resumed["losses"] == expected["losses"] and resumed["final_loss"] == expected["final_loss"]
    assert resumed["parameters_checksum"] == expected["parameters_checksum"]
    for (name, value), again in zip(_final_parameters(full).items(), _final_parameters(tmp_path).values()):
        assert torch.equal(value, again), name
    assert _folders(tmp_path) == _folders(full) == FINAL_FOLDERS


# ---------------------------------------------------------------------------------------- safe loading
def test_a_planted_pickle_is_refused_and_never_runs(tmp_path, uninterrupted):
    full, _ = uninterrupted
    state = latest_checkpoint(full / CHECKPOINT) / STATE_FILE
    assert set(read_state(state)) >= {"model", "optimizer", "scheduler", "sampler", "rng"}  # all of it loads safely

    marker = tmp_path / "payload_ran"
    planted = tmp_path / "planted" / CHECKPOINT / "step-000002"
    planted.mkdir(parents=True)
    torch.save({"model": Payload(marker)}, planted / STATE_FILE)
    with pytest.raises(InputError, match=rf"{planted / STATE_FILE}.*refused"):
        train(TrainConfig(out=str(tmp_path / "planted"), resume=True, **SETTINGS))
    assert not marker.exists()
    torch.load(planted / STATE_FILE, weights_only=False)  # the payload is live: an unsafe load runs it
    assert marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as it says
def test_a_dcp_value_with_a_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload_ran"
    dcp.save({"optimizer": {"lr": Payload(marker), "exp_avg": torch.ones(2)}}, checkpoint_id=tmp_path / "dcp")
    state = {"optimizer": {"lr": 0.0, "exp_avg": torch.zeros(2)}}
    with pytest.raises(InputError, match=r"optimizer\.lr holds objects other than .* refused.*GLOBAL posix\.system"):
        read_dcp(state, tmp_path / "dcp")
    assert not marker.exists()
    dcp.load(state, checkpoint_id=tmp_path / "dcp")  # the payload is live: DCP's own planner runs it
    assert marker.exists()


def test_dcp_metadata_with_a_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "payload_ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(InputError, match=r"\.metadata names objects other than DCP's records"):
        read_dcp_metadata(tmp_path)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- FSDP, two ranks
@pytest.mark.distributed
def test_fsdp_killed_inside_a_save_resumes_to_the_same_bits_and_refuses_payloads(tmp_path):
    env = {**_worker_env(), "GLOO_SOCKET_IFNAME": "lo"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    killed = subprocess.run([*launch, str(WORKERS / "killed_save.py"), str(tmp_path / "cut"), "writing"], env=env,
                            cwd=REPO, capture_output=True, text=True, timeout=240)
    assert killed.returncode != 0 and re.search(r"exitcode\s*:\s*-9\b", killed.stderr), killed.stderr[-3000:]
    assert LEFT_BY_KILL["writing"] in _folders(tmp_path / "cut")

    resumed = subprocess.run([*launch, str(WORKERS / "sharded_resume.py"), str(tmp_path)], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["resumed_from"] == RESUMED_FROM["writing"]
        assert seen["resumed"] == seen["full"] and len(seen["full"]) == SETTINGS["max_steps"]
        assert seen["left"] == FINAL_FOLDERS
        refusals = seen["refusals"]
        assert ".metadata names objects other than DCP's records" in refusals[".metadata"], rank
        assert (f"{tmp_path / 'plantedrank1.pt'}" if rank == 1 else "refused on rank(s) [1]") in refusals["rank1.pt"]
    assert not any((tmp_path / f"marker{file}").exists() for file in PLANTED)
