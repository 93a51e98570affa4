"""The runtime guard wired into every trainer: a leak that starts at step k is caught at the first check
after it; a correct model is never flagged over a full run and trains exactly as without the guard."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

from hybrid_pack.cli import main
from hybrid_pack.errors import IsolationError
from hybrid_pack.isolation import TOLERANCE
from hybrid_pack.modeling import from_preset
from hybrid_pack.schema import INPUT_IDS
from hybrid_pack.training import DEFAULT_GUARD_EVERY, IsolationFailed, TrainConfig, train
from hybrid_pack.training import trainer as trainer_module
from hybrid_pack.training.data import build_features, load_chats
from tests.testing.late_leak import LeakAfter

ROOT = Path(__file__).parents[2]
SMALL_RUN = {"max_examples": 48, "capacity": 512, "progress": False, "lr": 1e-3}


def _checks(guard: dict) -> list[tuple[int, bool]]:
    return [(r["step"], r["ok"]) for r in guard["records"]]


def test_native_trainer_catches_a_leak_at_the_first_check_after_it_starts(tmp_path, monkeypatch):
    def build_leaky_model(cfg: TrainConfig) -> torch.nn.Module:
        torch.manual_seed(cfg.seed)
        model = from_preset(cfg.model)
        LeakAfter(model.model.layers[1].mixer, after=4)   # ignores its boundaries from step 4 on
        return model

    monkeypatch.setattr(trainer_module, "build_model", build_leaky_model)
    with pytest.raises(IsolationError, match="step 6") as info:
        train(TrainConfig(out=str(tmp_path), max_steps=8, guard_every=3, **SMALL_RUN))
    assert isinstance(info.value, IsolationFailed)
    guard = json.loads((tmp_path / "metrics.json").read_text())["guard"]
    assert _checks(guard) == [(0, True), (3, True), (6, False)] and guard["failures"] == 1


@pytest.mark.parametrize(("preset", "dtype"), [("qwen3-next-tiny", "float32"), ("bamba-tiny", "bfloat16")])
def test_native_trainer_never_flags_a_correct_model_and_trains_as_without_guard(tmp_path, preset, dtype):
    cfg = {**SMALL_RUN, "model": preset, "dtype": dtype, "max_steps": 6}
    guarded = train(TrainConfig(out=str(tmp_path / "guarded"), guard_every=1, **cfg))
    plain = train(TrainConfig(out=str(tmp_path / "plain"), guard_every=0, **cfg))
    assert guarded["guard"]["checks"] == guarded["steps"] > 5 and guarded["guard"]["failures"] == 0
    assert guarded["guard"]["records"][0]["atol"] == TOLERANCE[getattr(torch, dtype)]
    assert guarded["losses"] == plain["losses"] and "guard" not in plain
    assert guarded["parameters_checksum"] == plain["parameters_checksum"]


def test_cli_guard_is_on_by_default_and_off_with_zero(tmp_path, capsys):
    args = ["train", "--max-examples", "24", "--capacity", "512", "--max-steps", "2", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "on")]) == 0
    guard = json.loads((tmp_path / "on" / "metrics.json").read_text())["guard"]
    assert guard["every"] == DEFAULT_GUARD_EVERY and _checks(guard) == [(0, True)]
    assert "runtime guard" in capsys.readouterr().out
    assert main([*args, "--out", str(tmp_path / "off"), "--guard-every", "0"]) == 0
    assert "guard" not in json.loads((tmp_path / "off" / "metrics.json").read_text())
    assert main([*args, "--out", str(tmp_path / "bad"), "--guard-every", "-1"]) == 2
    assert "guard_every" in capsys.readouterr().err


def _hf_trainer(model: torch.nn.Module, out: Path, steps: int, callback: object) -> object:
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    features, _ = build_features(load_chats("gsm8k", 48), model.config.vocab_size, max_length=512)
    args = TrainingArguments(str(out), max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-3,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True)
    return PackedTrainer(model=model, args=args, train_dataset=features, callbacks=[callback],
                         lengths=[len(f[INPUT_IDS]) for f in features], capacity=512)


def _native_model() -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny")
    return model, model.model.layers[1].mixer


def _patched_hf_model() -> tuple[torch.nn.Module, torch.nn.Module]:
    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model

    model = patch_model(tiny_model("qwen3_next"))
    return model, model.model.layers[0].linear_attn


@pytest.mark.parametrize("build", [_native_model, _patched_hf_model], ids=["native preset", "patched tiny HF"])
def test_hugging_face_trainer_callback_catches_a_late_leak_and_logs_checks(tmp_path, build):
    from hybrid_pack.integrations.transformers.guard import PackingGuardCallback

    model, mixer = build()
    callback = PackingGuardCallback(every=2)
    trainer = _hf_trainer(model, tmp_path / "clean", 3, callback)
    trainer.train()
    assert [(r.step, r.ok) for r in callback.guard.records] == [(0, True), (2, True)]
    logged = [(log["step"], log["guard_checks"]) for log in trainer.state.log_history if "guard_checks" in log]
    assert logged == [(1, 1), (3, 2)]                        # log entries after each check

    model, mixer = build()
    LeakAfter(mixer, after=3)                                # leaks from optimizer step 3 on
    callback = PackingGuardCallback(every=2)
    with pytest.raises(IsolationError, match="step 4"):
        _hf_trainer(model, tmp_path / "leaky", 6, callback).train()
    assert [(r.step, r.ok) for r in callback.guard.records] == [(0, True), (2, True), (4, False)]


def test_callback_refuses_bad_settings_when_built():
    from hybrid_pack.errors import InputError
    from hybrid_pack.integrations.transformers.guard import PackingGuardCallback

    with pytest.raises(InputError, match="every"):
        PackingGuardCallback(every=0)


def test_plain_loop_example_checks_every_nth_step(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    from guard_plain_loop import main as example

    result = example(["--examples", "24", "--capacity", "512", "--guard-every", "2"])
    steps = len(result["losses"])
    assert [r["step"] for r in result["records"]] == list(range(0, steps, 2)) and steps >= 3
    assert all(r["ok"] for r in result["records"])


def test_guard_docs_snippet_runs(tmp_path):
    snippet = (ROOT / "docs" / "guard.md").read_text().split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "guard_snippet.py").write_text(snippet)
    runpy.run_path(str(tmp_path / "guard_snippet.py"), run_name="__main__")
