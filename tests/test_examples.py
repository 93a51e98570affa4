"""The examples run and do what they say."""

import runpy
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_hf_trainer_example_trains_packed(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from hf_trainer import main

    result = main(["--examples", "40", "--max-steps", "3", "--capacity", "1024", "--out", str(tmp_path)])
    assert result["steps"] == 3 and len(result["losses"]) == 3
    assert result["losses"][-1] < result["losses"][0]


def test_rl_tool_masks_example_runs(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["rl_tool_masks.py"])
    try:
        runpy.run_path(str(EXAMPLES / "rl_tool_masks.py"), run_name="__main__")
    except SystemExit as err:
        assert not err.code, f"example exited with {err.code}"
