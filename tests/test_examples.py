"""The examples run and do what they say."""

import math
from pathlib import Path

EXAMPLES = Path(__file__).parents[1] / "examples"


def test_hf_trainer_example_trains_packed(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from hf_trainer import main

    result = main(["--examples", "40", "--max-steps", "3", "--capacity", "1024", "--out", str(tmp_path)])
    assert result["steps"] == 3 and len(result["losses"]) == 3
    assert result["losses"][-1] < result["losses"][0]


def test_rl_tool_masks_example_masks_tool_outputs_and_trains_policy_tokens(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from rl_tool_masks import main

    summary = main(["--max-packs", "2"])
    assert summary["packs"] >= 2 and 0 < summary["masked_tokens"] < summary["response_tokens"]
    assert len(summary["steps"]) == 2
    for step in summary["steps"]:
        assert step["leaked_gradient"] == 0.0  # no logit predicting a prompt or tool token gets gradient
        assert step["policy_gradient"] > 0.0  # the policy's own tokens do
        assert step["rollouts"] > 1 and step["tokens"] <= 16384 and math.isfinite(step["loss"])
    assert "<tool_response>" in summary["masked_tool_output"]
