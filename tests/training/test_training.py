"""Training: packed equals padded on the same batch, resume is exact, torchrun ranks agree, the CLI works."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybrid_pack import PackingCollator
from hybrid_pack.cli import main
from hybrid_pack.modeling import from_preset
from hybrid_pack.training import PaddingCollator, TrainConfig, train
from hybrid_pack.training import checkpoint as checkpoint_module
from hybrid_pack.training.checkpoint import CHECKPOINT, STATE_FILE, latest_checkpoint, read_state


def _features(seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 1, 33, 64, 65, 5]
    feats = []
    for n in lengths:
        ids = torch.randint(1, 500, (n,), generator=g).tolist()
        labels = [-100 if i < n // 3 else t for i, t in enumerate(ids)]
        feats.append({"input_ids": ids, "labels": labels})
    return feats


@pytest.mark.parametrize("preset", ["qwen3-next-tiny", "bamba-tiny"])
def test_same_batch_packed_and_padded_give_same_loss_and_gradients(preset):
    torch.manual_seed(0)
    model = from_preset(preset, vocab_size=512).train()
    feats = _features()
    packed = PackingCollator()(feats)
    padded = PaddingCollator()(feats)
    loss_packed = model(**packed).loss
    grads_packed = torch.autograd.grad(loss_packed, list(model.parameters()))
    loss_padded = model(input_ids=padded["input_ids"], labels=padded["labels"]).loss
    grads_padded = torch.autograd.grad(loss_padded, list(model.parameters()))
    torch.testing.assert_close(loss_packed, loss_padded, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_packed, grads_padded):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_padding_collator_masks_padding_and_first_tokens():
    batch = PaddingCollator(pad_token_id=9)([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [-100, -100, -100]]


def _params(path):
    return read_state(latest_checkpoint(path / CHECKPOINT) / STATE_FILE)["model"]


def test_resume_after_a_stop_reaches_the_same_parameters(tmp_path, monkeypatch):
    cfg = {"max_examples": 60, "capacity": 1024, "max_steps": 4, "checkpoint_every": 2, "progress": False, "lr": 1e-2}
    full = train(TrainConfig(out=str(tmp_path / "full"), **cfg))

    save = checkpoint_module.save_checkpoint

    def crash_after_step_two(path, model, optimizer, scheduler, sampler, step, stats, **options):
        save(path, model, optimizer, scheduler, sampler, step, stats, **options)
        if step == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint_module, "save_checkpoint", crash_after_step_two)
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=str(tmp_path / "cut"), **cfg))
    monkeypatch.setattr(checkpoint_module, "save_checkpoint", save)
    resumed = train(TrainConfig(out=str(tmp_path / "cut"), resume=True, **cfg))

    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-6)
    for (name, a), b in zip(_params(tmp_path / "full").items(), _params(tmp_path / "cut").values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_compare_padded_metrics_and_plots(tmp_path):
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--max-examples", "40", "--capacity", "1024", "--max-steps", "3",
                 "--compare-padded", "--isolation-check", "--no-progress"])
    assert code == 0
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("tokens_per_second", "packing_efficiency", "final_loss", "isolation_ok", "padded_tokens_per_second"):
        assert key in metrics
    assert metrics["isolation_ok"] is True and metrics["losses_agree"] is True
    assert metrics["same_batch_loss_rel_diff"] < 1e-5
    assert metrics["padded_tokens_ratio"] > 1.1
    assert (out / "loss.png").stat().st_size > 0 and (out / "pack_fill.png").stat().st_size > 0


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--capacity", "0"]) == 2
    assert "capacity" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path), "--data", "missing.jsonl"]) == 2
    with pytest.raises(SystemExit) as info:
        main(["train", "--epochs", "x"])
    assert info.value.code == 2
    assert main(["train", "--out", str(tmp_path), "--fsdp", "--max-examples", "4", "--no-progress"]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_user_jsonl_chats_are_what_trains(tmp_path):
    from hybrid_pack.training.data import build_features, load_chats
    from hybrid_pack.training.trainer import build_model

    data = tmp_path / "chats.jsonl"
    chats = [{"messages": [{"role": "user", "content": f"{n}+{n}?"}, {"role": "assistant", "content": str(2 * n)}]}
             for n in range(6)]
    data.write_text("\n".join(json.dumps(chat) for chat in chats))
    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(data), capacity=256, max_steps=1, lr=0.0, progress=False)
    metrics = train(cfg)
    first_pack = read_state(latest_checkpoint(tmp_path / "run" / CHECKPOINT) / STATE_FILE)["groups"][0]

    model = build_model(cfg).train()
    features, _ = build_features(load_chats(str(data), None), model.config.vocab_size, max_length=256)
    assert metrics["examples"] == 6 and metrics["real_tokens"] == sum(len(features[i]["input_ids"]) for i in first_pack)
    batch = PackingCollator()([features[i] for i in first_pack])
    with torch.no_grad():
        first_loss = float(model(**batch).loss)
    assert metrics["losses"][0] == pytest.approx(first_loss, rel=1e-5)  # the file's chats, not GSM8K


@pytest.mark.distributed
def test_torchrun_two_processes_agree(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "tests.workers.dist_train", str(tmp_path)]
    subprocess.run(cmd, check=True, env=env, timeout=300, cwd=Path(__file__).parents[2])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 3
    full = json.loads((tmp_path / "metrics.json").read_text())
    assert full["world_size"] == 2
    # stopped on every rank after the checkpoint of step 2, then resumed: what the run reports it trained is the
    # uninterrupted run's (each rank restores its own counts; rank 0's were restored on both, counted twice)
    resumed = json.loads((tmp_path / "cut" / "metrics.json").read_text())
    assert resumed["losses"] == pytest.approx(full["losses"], rel=1e-6)
    assert resumed["parameters_checksum"] == pytest.approx(full["parameters_checksum"], rel=1e-6)
    for key in ("packs", "documents_trained", "real_tokens"):
        assert resumed[key] == full[key], key


def test_hugging_face_directory_trains_with_boundaries(tmp_path):
    from hybrid_pack.integrations.transformers.tiny import tiny_config
    from hybrid_pack.training.data import build_features, load_chats
    from hybrid_pack.training.trainer import build_model

    model_dir = tmp_path / "bamba"
    tiny_config("bamba").save_pretrained(model_dir)
    cfg = TrainConfig(model=str(model_dir), out=str(tmp_path / "run"), max_examples=24, capacity=1024, max_steps=1,
                      progress=False, lr=0.0)
    metrics = train(cfg)
    first_pack = read_state(latest_checkpoint(tmp_path / "run" / CHECKPOINT) / STATE_FILE)["groups"][0]

    model = build_model(cfg).train()
    features, _ = build_features(load_chats("gsm8k", 24), model.config.vocab_size, max_length=1024)
    batch = PackingCollator()([features[i] for i in first_pack])
    expected = model(**batch).loss.detach()
    assert metrics["losses"][0] == pytest.approx(float(expected), rel=1e-5)
