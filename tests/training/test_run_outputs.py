"""What ``hybrid-pack train`` leaves a user: every lost example counted and named, the trained model saved the
usual way in tokenizer ids, per-step metrics for TensorBoard, and a padded comparison of like with like."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from hybrid_pack.cli import main
from hybrid_pack.modeling import HybridForCausalLM
from hybrid_pack.modeling.vocab import VocabRemap
from hybrid_pack.schema import INPUT_IDS
from hybrid_pack.training import TrainConfig, build_model
from hybrid_pack.training.checkpoint import CHECKPOINT, STATE_FILE, latest_checkpoint, read_state
from hybrid_pack.training.data import TOKENIZER_VOCAB, load_chats, prepare_data

CAPACITY = 160
ONE_TOKEN = 9707


def _chat(question: str, answer: str | None) -> dict:
    turns = [{"role": "user", "content": question}]
    return {"messages": turns + ([{"role": "assistant", "content": answer}] if answer is not None else [])}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    """Ten short chats, then one chat over CAPACITY tokens, one without an assistant turn, one of one token."""
    rows = [_chat(f"What is {n} + {n}?", f"It is {2 * n}.") for n in range(10)]
    rows += [_chat("Count.", " ".join(str(n) for n in range(120))), _chat("Nobody answers this.", None),
             {INPUT_IDS: [ONE_TOKEN]}]
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _run(args: list[str]) -> tuple[int, str]:
    """``hybrid-pack`` with ``args``; its exit code and what it printed (on a wide console: no wrapped cells)."""
    out, err = io.StringIO(), io.StringIO()
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "240"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        os.environ.pop("COLUMNS") if old is None else os.environ.__setitem__("COLUMNS", old)
    return code, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def run(data_file, tmp_path_factory) -> tuple[Path, dict, str]:
    """Two packed steps of qwen3-next-tiny on ``data_file``, truncating, compared with padded; TensorBoard on."""
    out = tmp_path_factory.mktemp("run")
    code, printed = _run(["train", "--data", str(data_file), "--out", str(out), "--capacity", str(CAPACITY),
                          "--overflow", "truncate", "--max-steps", "2", "--compare-padded", "--guard-every", "0",
                          "--report-to", "tensorboard", "--no-progress"])
    assert code == 0, printed
    return out, json.loads((out / "metrics.json").read_text()), printed


# ------------------------------------------------------------------ nothing lost silently
def test_metrics_count_every_lost_example_and_the_summary_names_them(run) -> None:
    _, metrics, printed = run
    assert metrics["examples"] == 13 and metrics["documents"] == 11 and metrics["overflow"] == "truncate"
    assert metrics["truncated_examples"] == 1 and metrics["split_examples"] == 0
    assert metrics["dropped_examples"] == 2
    assert metrics["dropped_examples_by_reason"] == {"one_token": 1, "no_targets": 1, "longer_than_capacity": 0}
    assert metrics["examples_without_targets"] == 1
    assert "examples truncated to --capacity  " in printed
    assert "examples dropped  " in printed and "1 one token" in printed and "1 no target token" in printed
    assert "examples without targets (dropped)" in printed
    assert "split into pieces" not in printed  # a count of zero is not shown


def test_an_over_long_example_stops_the_run_by_default_naming_it_and_the_fix(data_file, tmp_path) -> None:
    code, printed = _run(["train", "--data", str(data_file), "--out", str(tmp_path), "--capacity", str(CAPACITY),
                          "--no-progress"])
    assert code == 2
    assert "example 10 (counting from 0) has" in printed and "--overflow truncate, split or drop" in printed


@pytest.mark.parametrize(("overflow", "counts"), [
    ("split", {"split_examples": 1, "dropped_examples": 2}),
    ("drop", {"dropped_examples": 3, "documents": 10}),
    ("truncate", {"truncated_examples": 1, "documents": 11}),
])
def test_overflow_policies_are_counted(data_file, overflow: str, counts: dict) -> None:
    rows = load_chats(str(data_file))
    long = len(prepare_data(rows[10:11], 512, capacity=10_000).features[0][INPUT_IDS])
    data = prepare_data(rows, 512, capacity=CAPACITY, overflow=overflow)
    metrics = data.report.to_metrics()
    assert {key: metrics[key] for key in counts} == counts
    assert all(1 < len(f[INPUT_IDS]) <= CAPACITY for f in data.features)
    if overflow == "split":  # every piece kept: each holds answer tokens
        assert metrics["documents"] == 10 + -(-long // CAPACITY)
        assert sum(len(f[INPUT_IDS]) for f in data.features[10:]) == long
    if overflow == "drop":
        assert metrics["dropped_examples_by_reason"]["longer_than_capacity"] == 1


@pytest.mark.parametrize(("row", "message"), [
    ({INPUT_IDS: [1, TOKENIZER_VOCAB]}, r"data\[0\]\.input_ids: expected a list of Qwen3 token ids"),
    ({INPUT_IDS: [1, 2, 3], "labels": [2, 3]}, r"data\[0\]\.labels: expected 3 labels"),
    ({INPUT_IDS: [1, 2, 3], "labels": [1, 2.5, 3]}, r"data\[0\]\.labels: .* got 2\.5 at position 1"),
    ({INPUT_IDS: [1, 2, 3], "labels": [1, -1, 3]}, r"data\[0\]\.labels: .*or -100 .* got -1 at position 1"),
    ({INPUT_IDS: [1, 2, 3], "labels": [1, 2, TOKENIZER_VOCAB]}, r"data\[0\]\.labels: .* at position 2"),
    ({INPUT_IDS: [1, 2, 3], "labels": 5}, r"data\[0\]\.labels: .* got int 5"),
])
def test_a_malformed_tokenized_row_is_named(row: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prepare_data([row], 512, capacity=CAPACITY)


# ------------------------------------------------------------------ the saved model
def _trained_compact_model(out: Path, cfg: TrainConfig) -> torch.nn.Module:
    model = build_model(cfg)
    model.load_state_dict(read_state(latest_checkpoint(out / CHECKPOINT) / STATE_FILE)["model"])
    return model.eval()


def _assert_same_logits_in_tokenizer_ids(compact: torch.Tensor, full: torch.Tensor, remap: VocabRemap) -> None:
    """``full`` (over tokenizer ids) gives every kept id its compact logit and every other id the <unk> logit."""
    assert full.shape[-1] == TOKENIZER_VOCAB
    torch.testing.assert_close(full[..., torch.as_tensor(remap.kept_ids)], compact[..., 1:remap.size])
    others = np.setdiff1d(np.arange(TOKENIZER_VOCAB), remap.kept_ids)
    torch.testing.assert_close(full[..., torch.as_tensor(others)], compact[..., :1].expand(-1, -1, others.size))


def test_saved_model_loads_and_gives_the_trained_logits_over_tokenizer_ids(run, data_file) -> None:
    out, metrics, printed = run
    assert metrics["model_dir"] == str(out / "model") and metrics["compact_vocabulary"] is not None
    assert "small-vocabulary demo model" in printed
    assert {p.name for p in (out / "model").iterdir()} >= {"config.json", "model.safetensors"}
    assert "small-vocabulary demo model" in (out / "model" / "COMPACT_VOCABULARY.md").read_text().lower()
    from transformers import AutoTokenizer

    from hybrid_pack.data import load_tokenizer

    text = "<|im_start|>user\nWhat is 7 + 7?<|im_end|>\n"
    assert AutoTokenizer.from_pretrained(out / "model").encode(text) == load_tokenizer().encode(text).ids
    remap = VocabRemap.load(out / "vocab_remap.json")
    tokenizer_ids = torch.tensor([prepare_data(load_chats(str(data_file)), TOKENIZER_VOCAB, capacity=CAPACITY,
                                               overflow="truncate").features[10][INPUT_IDS]])
    saved = HybridForCausalLM.from_pretrained(out / "model").eval()
    assert saved.config.vocab_size == TOKENIZER_VOCAB
    assert saved.lm_head.weight is saved.model.embed_tokens.weight
    compact = _trained_compact_model(out, TrainConfig(out=str(out)))
    with torch.no_grad():
        _assert_same_logits_in_tokenizer_ids(compact(input_ids=remap.encode(tokenizer_ids)).logits,
                                             saved(input_ids=tokenizer_ids).logits, remap)


def test_a_hugging_face_model_is_saved_in_its_own_format(data_file, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from hybrid_pack.integrations.transformers.tiny import tiny_config

    model_dir, out = tmp_path / "bamba", tmp_path / "run"
    tiny_config("bamba").save_pretrained(model_dir)
    code, printed = _run(["train", "--model", str(model_dir), "--data", str(data_file), "--out", str(out),
                          "--capacity", str(CAPACITY), "--overflow", "drop", "--max-steps", "2", "--guard-every", "0",
                          "--no-progress"])
    assert code == 0, printed
    remap = VocabRemap.load(out / "vocab_remap.json")
    tokenizer_ids = torch.tensor([[ONE_TOKEN, *remap.kept_ids[:20].tolist(), 5, 77]])
    saved = AutoModelForCausalLM.from_pretrained(out / "model").float().eval()
    compact = _trained_compact_model(out, TrainConfig(model=str(model_dir), out=str(out)))
    with torch.no_grad():
        _assert_same_logits_in_tokenizer_ids(compact(input_ids=remap.encode(tokenizer_ids)).logits,
                                             saved(input_ids=tokenizer_ids).logits, remap)


# ------------------------------------------------------------------ reporting and the padded comparison
def test_report_to_tensorboard_writes_every_step(run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, metrics, _ = run
    events = EventAccumulator(str(out / "runs"))
    events.Reload()
    assert {"train/loss", "train/learning_rate", "train/tokens_per_second"} <= set(events.Tags()["scalars"])
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(metrics["losses"])


def test_report_to_a_missing_package_names_the_extra(monkeypatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else find_spec(name))
    with pytest.raises(ValueError, match=r"'wandb' needs the wandb package; pip install 'hybrid_pack\[wandb\]'"):
        TrainConfig(report_to="wandb")
    with pytest.raises(ValueError, match=r"report_to: expected 'none', 'all'"):
        TrainConfig(report_to=["tensorboard", "mlflow"])


def test_compare_padded_runs_as_many_steps_and_flags_a_too_short_run(run) -> None:
    _, metrics, printed = run
    assert metrics["padded_steps"] == metrics["steps"] == 2 and metrics["timed_steps"] == 1
    assert "run too short to judge: 1 timed step(s)" in metrics["speedup_verdict"]
    assert metrics["speedup_meets_target"] == (metrics["speedup"] >= metrics["target_speedup"])
    assert metrics["speedup_verdict"] in printed


@pytest.mark.slow  # wandb starts its own service process (~5 s alone, longer on a busy machine)
def test_report_to_wandb_offline_logs_every_step(tmp_path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    from hybrid_pack.training.reporting import Reporter, report_targets

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    reporter = Reporter(report_targets("wandb"), tmp_path, {"lr": 1e-3})
    for step, loss in enumerate([2.0, 1.5], 1):
        reporter.log(step, {"train/loss": loss})
    assert reporter.runs[0].config["lr"] == 1e-3 and reporter.runs[0].offline
    reporter.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.stat().st_size > 0


def test_a_saved_native_model_trains_again(tmp_path):
    """The run's own ``model/`` folder (a native ``save_pretrained``) was sent to transformers, which cannot read
    it: ``train --model`` on it failed, though the docs say a saved checkpoint trains again."""
    from hybrid_pack.data.tokenizer import save_tokenizer
    from hybrid_pack.modeling import from_preset

    folder = tmp_path / "model"
    saved = from_preset("qwen3-next-tiny", vocab_size=TOKENIZER_VOCAB)
    saved.save_pretrained(folder)
    save_tokenizer(folder)
    assert HybridForCausalLM.saved_in(folder) and not HybridForCausalLM.saved_in(tmp_path)
    model = build_model(TrainConfig(model=str(folder), out=str(tmp_path / "run")))
    assert isinstance(model, HybridForCausalLM)
    for (name, want), got in zip(saved.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(want, got), name
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "layer_pattern": "GA"}))
    assert not HybridForCausalLM.saved_in(tmp_path / "hf")
