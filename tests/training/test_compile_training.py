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
    assert metrics["compiles"] == 1 and metrics["pack_length"] == 256 and metrics["max_documents"] >= 1
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    assert metrics["guard"]["checks"] == 2 and metrics["steps"] == 4 and metrics["padded_steps"] == 4


def test_compile_with_context_parallel_is_refused() -> None:
    with pytest.raises(InputError, match="compile"):
        TrainConfig(compile=True, context_parallel=2)
