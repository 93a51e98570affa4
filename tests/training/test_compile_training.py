"""``hybrid-pack train --compile``: static batches chosen for the user, one compiled graph, counted in metrics.json.

The trainer's ``torch.compile`` is given ``backend="aot_eager"`` here (what is proved, the graphs and their
guards, is dynamo's; the inductor path is proved in tests/modeling/test_compile.py).
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from torch._dynamo.utils import counters

from hybrid_pack.cli import main
from hybrid_pack.errors import InputError
from hybrid_pack.training import TrainConfig
from tests.workers import compile_train
from tests.workers.launch import torchrun

WORKER = compile_train.__file__


@pytest.mark.slow
def test_train_compile_records_one_compilation(tmp_path, monkeypatch) -> None:
    """One graph for the whole run: the guard's hooks and its own calls stay outside it, and the padded comparison
    (other shapes) runs the model eagerly."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    out = tmp_path / "run"
    graphs_before = counters["stats"]["unique_graphs"]
    code = main(["train", "--compile", "--out", str(out), "--max-examples", "24", "--capacity", "256",
                 "--max-steps", "4", "--guard-every", "2", "--no-progress", "--overflow", "truncate",
                 "--compare-padded"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["compiles"] == 1 and metrics["recompiles"] == 0
    assert metrics["pack_length"] == 256 and metrics["max_documents"] >= 1
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert metrics["guard"]["checks"] == 2 and metrics["steps"] == 4 and metrics["padded_steps"] == 4


def test_compile_composes_with_fsdp_and_context_parallel_on_rows_that_divide() -> None:
    TrainConfig(compile=True, fsdp=True, context_parallel=2, capacity=64)
    TrainConfig(compile=True, context_parallel=2, cp_layout="zigzag", capacity=64)
    with pytest.raises(InputError, match="capacity: .* divide by 4"):
        TrainConfig(compile=True, context_parallel=2, cp_layout="zigzag", capacity=66)


@pytest.mark.slow
@pytest.mark.distributed
def test_train_compile_composes_with_fsdp_and_context_parallel(tmp_path) -> None:
    """``train --compile`` with ``--fsdp --activation-checkpointing`` (the guard checking every step) and with
    ``--context-parallel 2 --cp-layout zigzag`` on 2 gloo ranks equals the eager run (losses, 1e-5), with every
    graph compiled in the first step (at most one per block kind: bamba-tiny has two) and whole rows counted."""
    out = tmp_path / "runs.json"
    torchrun(WORKER, str(out), "fsdp", "context_parallel", processes=2, timeout=900)
    runs = json.loads(out.read_text())
    for case, run in runs.items():
        eager, compiled = run["eager"], run["compiled"]
        assert compiled["compiled"] == "every decoder block", case
        assert compiled["compiles"] >= 1 and compiled["recompiles"] == 0, (case, compiled)
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=1e-5, msg=case)
        assert compiled["real_tokens"] == eager["real_tokens"] and compiled["documents_trained"] == eager[
            "documents_trained"], case
    assert runs["fsdp"]["compiled"]["compiles"] == 2  # one graph per block kind, nothing between them
    guarded = runs["fsdp"]["compiled"]
    assert guarded["guard"]["checks"] == len(guarded["losses"]) >= 2 and guarded["guard"]["failures"] == 0
