"""``hybrid-pack train`` and ``demo`` take their options from :class:`TrainConfig`'s fields: every field has its
``--kebab-case`` option with its help, a parsed command line is the config it names, and every flag the docs and
earlier releases use still parses."""

from __future__ import annotations

import dataclasses

import pytest

import hybrid_pack.training
from hybrid_pack.cli import main
from hybrid_pack.errors import InputError
from hybrid_pack.packing.plan import OVERFLOW_POLICIES
from hybrid_pack.training import DEFAULT_GUARD_EVERY, TrainConfig

FLAGS = ("--out", "--model", "--max-examples", "--capacity", "--overflow", "--report-to", "--seed", "--no-progress",
         "--guard-every", "--data", "--epochs", "--max-steps", "--grad-accum", "--lr", "--warmup-steps",
         "--weight-decay", "--dtype", "--device", "--compare-padded", "--isolation-check", "--checkpoint-every",
         "--resume", "--fsdp", "--context-parallel", "--compile")
"""``hybrid-pack train``'s flags before its options were generated (docs/training.md lists them)."""


class Parsed(Exception):
    def __init__(self, config: TrainConfig) -> None:
        self.config = config


@pytest.fixture
def parse(monkeypatch: pytest.MonkeyPatch):
    """``parse("train", "--lr", "1")``: the TrainConfig the command line gives ``train`` (nothing is trained)."""

    def stop(config: TrainConfig) -> None:
        raise Parsed(config)

    monkeypatch.setattr(hybrid_pack.training, "train", stop)

    def run(*argv: str) -> TrainConfig:
        with pytest.raises(Parsed) as parsed:
            main(list(argv))
        return parsed.value.config

    return run


def help_text(command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """``hybrid-pack COMMAND --help``, one line per option."""
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_every_field_is_an_option_with_its_help(capsys, monkeypatch):
    text = help_text("train", capsys, monkeypatch)
    for setting in dataclasses.fields(TrainConfig):
        assert setting.metadata["help"], f"{setting.name}: no help"
        flag = "--" + ("no-" if setting.default is True else "") + setting.name.replace("_", "-")
        assert f" {flag}" in text, f"{setting.name}: no {flag} in hybrid-pack train --help"
    assert all(f" {flag}" in text for flag in FLAGS)
    guard = next(line for line in text.splitlines() if line.strip().startswith("--guard-every N"))
    assert guard.endswith(f"(default: {DEFAULT_GUARD_EVERY})")


def test_no_options_give_the_default_config(parse):
    assert parse("train") == TrainConfig()


def test_each_option_sets_its_field(parse, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("")
    config = parse("train", "--out", "o", "--model", "bamba-tiny", "--max-examples", "7", "--capacity", "64",
                   "--overflow", "split", "--report-to", "tensorboard", "--seed", "3", "--no-progress",
                   "--guard-every", "0", "--data", str(data), "--epochs", "2", "--max-steps", "5", "--grad-accum", "4",
                   "--lr", "0.5", "--warmup-steps", "1", "--weight-decay", "0", "--min-lr-ratio", "0.2",
                   "--max-grad-norm", "2", "--dtype", "float32", "--device", "cpu", "--compare-padded",
                   "--isolation-check", "--checkpoint-every", "9", "--resume", "--compile")
    expected = TrainConfig(out="o", model="bamba-tiny", max_examples=7, capacity=64, overflow="split",
                           report_to=["tensorboard"], seed=3, progress=False, guard_every=0, data=str(data),
                           epochs=2, max_steps=5, grad_accum=4, lr=0.5, warmup_steps=1, weight_decay=0.0,
                           min_lr_ratio=0.2, max_grad_norm=2.0, dtype="float32", device="cpu", compare_padded=True,
                           isolation_check=True, checkpoint_every=9, resume=True, compile=True)
    assert config == expected
    assert parse("train", "--context-parallel", "2").context_parallel == 2
    assert parse("train", "--fsdp").fsdp
    assert parse("train", "--report-to", "tensorboard", "tensorboard").report_to == ["tensorboard", "tensorboard"]


def test_demo_takes_its_own_defaults_and_always_compares(parse, capsys, monkeypatch):
    config = parse("demo")
    assert (config.out, config.max_examples, config.compare_padded, config.isolation_check) == (
        "runs/demo", 600, True, True)
    assert parse("demo", "--max-examples", "8", "--no-progress").max_examples == 8
    text = help_text("demo", capsys, monkeypatch)
    assert "--epochs" not in text and "(default: 600)" in text
    assert "all when not given" not in " ".join(text.split()), "the demo's default is 600, not all"


@pytest.mark.parametrize(("argv", "field"), [(["--overflow", "wrap"], "overflow"), (["--dtype", "float16"], "dtype"),
                                              (["--epochs", "x"], "epochs")])
def test_a_value_outside_the_choices_exits_2(argv, field, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2 and argv[0] in capsys.readouterr().err


def test_the_config_checks_the_choices_its_options_offer():
    assert dataclasses.fields(TrainConfig)[[f.name for f in dataclasses.fields(TrainConfig)].index(
        "overflow")].metadata["choices"] == OVERFLOW_POLICIES
    with pytest.raises(InputError, match=r"dtype: expected one of 'auto', 'float32', 'bfloat16'; got 'float16'"):
        TrainConfig(dtype="float16")
    with pytest.raises(InputError, match=r"overflow: expected one of 'error', 'truncate', 'split', 'drop'"):
        TrainConfig(overflow="wrap")


@pytest.mark.parametrize(("argv", "message"), [
    (["train", "--lr", "-1"], "lr: expected a number >= 0; got -1.0"),
    (["train", "--max-grad-norm", "nan"], "max_grad_norm: expected a number >= 0; got nan"),
    (["train", "--device", "nodev"], "device: expected cpu, cuda, cuda:1 ...; got 'nodev'"),
    (["check", "qwen3-next-tiny", "--lengths", "a,b"], "--lengths: expected comma-separated document lengths"),
    (["check", "qwen3-next-tiny", "--lengths", ""], "--lengths: expected comma-separated document lengths"),
    (["check", "--trainer", "no_such_module_here:make"], "--trainer: cannot import 'no_such_module_here'"),
    (["check", "qwen3-next-tiny", "--json", "/no/such/folder/r.json"], "--json: the folder of '/no/such/folder/"),
    (["train", "--checkpoint-every", "-1"], "checkpoint_every: expected an int >= 0"),
    (["bench", "--tokens", "0"], "--tokens: expected at least 8192 tokens per row"),
    (["bench", "--tokens", "512"], "--tokens: expected at least 8192 tokens per row"),
    (["bench", "--tokens", "9000", "--skip-kernels"], "--tokens: sets the kernel benchmark's rows"),
    (["bench", "--steps", "1"], "--steps: expected at least 2"),
    (["bench", "--out", __file__], "--out: "),
])
def test_a_bad_value_is_one_line_naming_it_and_exits_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_data_line_that_is_not_json_is_named(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": [\n')
    assert main(["train", "--data", str(data), "--out", str(tmp_path / "run")]) == 2
    assert f"data: line 2 of {data} is not JSON" in capsys.readouterr().err


def test_bad_files_and_folders_are_named(tmp_path, capsys):
    """An --out that is a file, data that is not UTF-8, a model folder transformers cannot build: one line naming
    the option, exit 2 (never a traceback, and never 1, a failed check's code)."""
    (tmp_path / "a_file").write_text("")
    (tmp_path / "latin1.jsonl").write_bytes(b'\xff\xfe{"input_ids": [1, 2]}\n')
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text('{"model_type": "no_such_architecture"}')
    cases = [(["train", "--out", str(tmp_path / "a_file")], "out: "),
             (["train", "--data", str(tmp_path / "latin1.jsonl"), "--out", str(tmp_path / "r1")],
              "data: " + str(tmp_path / "latin1.jsonl") + " is not UTF-8"),
             (["train", "--model", str(tmp_path / "unknown"), "--out", str(tmp_path / "r2")],
              "model: transformers"),
             (["check", str(tmp_path / "unknown")], "model: transformers")]
    for argv, message in cases:
        assert main([*argv, "--no-progress"] if argv[0] == "train" else argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err


def test_the_summary_counts_split_pieces_as_pieces():
    """Under --overflow split a piece without targets is dropped alone: the summary said "examples dropped 2" for
    two pieces of one example, where no example was dropped."""
    from hybrid_pack.cli import _data_loss_rows

    counts = {"truncated_examples": 0, "dropped_examples": 2, "examples_without_targets": 2,
              "dropped_examples_by_reason": {"no_targets": 2}}
    assert [label for label, _ in _data_loss_rows({**counts, "split_examples": 1})] == [
        "examples split into pieces of --capacity", "examples or split pieces dropped",
        "examples or split pieces without targets (dropped)"]
    assert [label for label, _ in _data_loss_rows({**counts, "split_examples": 0})] == [
        "examples dropped", "examples without targets (dropped)"]
