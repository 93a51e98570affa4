"""PackedTrainer logs real (non-padding) tokens/s, counted on the host, not samples/s of packs."""

from __future__ import annotations

import itertools

import pytest

from hybrid_pack import PackedBatchSampler, PackingCollator
from hybrid_pack.modeling import from_preset
from hybrid_pack.schema import INPUT_IDS
from hybrid_pack.training.data import build_features, load_chats


def test_packed_trainer_logs_real_tokens_per_second(tmp_path) -> None:
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    model = from_preset("qwen3-next-tiny", vocab_size=512)
    features, _ = build_features(load_chats("gsm8k", 24), model.config.vocab_size, max_length=512)
    lengths = [len(f[INPUT_IDS]) for f in features]
    args = TrainingArguments(str(tmp_path), max_steps=3, per_device_train_batch_size=1, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = PackedTrainer(model=model, args=args, train_dataset=features, lengths=lengths, capacity=512,
                            collator=PackingCollator(pad_to_multiple_of=128))  # padding that must not count
    trainer.train()

    packs = itertools.islice(PackedBatchSampler(lengths, 512, rank=None, seed=args.seed), 3)
    real = list(itertools.accumulate(sum(lengths[i] for i in pack) for pack in packs))
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["real_tokens_seen"] for log in logs] == real
    assert all(log["tokens_per_second"] > 0 for log in logs)
    final = trainer.state.log_history[-1]
    assert final["train_tokens_per_second"] == pytest.approx(real[-1] / final["train_runtime"])


def test_packed_trainer_drops_unused_dataset_columns_as_trainer_does(tmp_path) -> None:
    """``remove_unused_columns=True`` (Trainer's default): a patched HF model's forward names ``input_ids`` and
    ``labels``; a ``text`` column beside them never reaches the collator (which would refuse an unknown key)."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model
    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    lengths = [5, 9, 3, 12, 7, 4]
    dataset = Dataset.from_list([{INPUT_IDS: list(range(3, 3 + n)), "text": f"doc {i}"} for i, n in enumerate(lengths)])
    args = TrainingArguments(str(tmp_path), max_steps=2, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    assert args.remove_unused_columns
    trainer = PackedTrainer(model=patch_model(tiny_model("bamba")), args=args, train_dataset=dataset,
                            lengths=lengths, capacity=24)
    trainer.train()
    assert trainer.state.global_step == 2


def test_a_warm_up_that_raised_runs_again(tmp_path, monkeypatch) -> None:
    """The trainer marked a gradient mode warmed up before its warm-up ran: one that raised (a bad first batch,
    caught and retried) was never run again, and the next batch's kernels served unsettled."""
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers import trainer as trainer_module
    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    model = from_preset("qwen3-next-tiny", vocab_size=512)
    features, _ = build_features(load_chats("gsm8k", 4), model.config.vocab_size, max_length=512)
    lengths = [len(f[INPUT_IDS]) for f in features]
    args = TrainingArguments(str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True)
    trainer = PackedTrainer(model=model, args=args, train_dataset=features, lengths=lengths, capacity=512)
    calls = []

    def verify(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise RuntimeError("planted: the first warm-up fails")
        return []

    monkeypatch.setattr(trainer_module.backends, "verify", verify)
    with pytest.raises(RuntimeError, match="planted"):
        trainer.warm_up_backends(model, {})
    trainer.warm_up_backends(model, {})
    trainer.warm_up_backends(model, {})
    assert len(calls) == 2


def test_trainer_evaluates_and_predicts_a_native_model_with_its_defaults(tmp_path) -> None:
    """transformers' ``Trainer`` takes every forward parameter named like a label for one the batch must hold:
    with ``shift_labels`` among them, ``evaluate()`` reported no ``eval_loss`` and ``predict()`` raised."""
    import torch
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny", vocab_size=128)
    rows = [{INPUT_IDS: torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (10, 20, 5, 7)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args, eval_dataset=rows, data_collator=PackingCollator())
    assert trainer.label_names == ["labels"]
    with torch.no_grad():
        expected = model(**PackingCollator()(rows)).loss.item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert trainer.predict(rows).metrics["test_loss"] == pytest.approx(expected, rel=1e-6)


def test_checkpoints_of_a_native_model_with_a_tied_head_save_and_resume(tmp_path) -> None:
    """The ``Trainer`` wrote a native model's state dict with safetensors, which refuses the tied head and
    embedding: ``save_steps`` and ``save_model()`` raised. Now the model's own ``save_pretrained`` writes them."""
    import torch
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.trainer import PackedTrainer
    from hybrid_pack.modeling import HybridForCausalLM

    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny", vocab_size=128)
    assert model.config.tie_word_embeddings
    rows = [{INPUT_IDS: torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (10, 20, 5, 7)]
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, save_steps=1, report_to=[], use_cpu=True,
                             disable_tqdm=True)
    trainer = PackedTrainer(model=model, args=args, train_dataset=rows, lengths=[len(r[INPUT_IDS]) for r in rows],
                            capacity=32)
    trainer.train()
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    trainer.save_model(str(tmp_path / "saved"))
    loaded = HybridForCausalLM.from_pretrained(tmp_path / "saved")
    for (name, want), got in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(want, got), name


def test_neftune_gives_each_packed_document_the_noise_it_gets_alone(tmp_path) -> None:
    """transformers' NEFTune hook scales its noise by the sequence length ``alpha / sqrt(L * d)``: on a packed row
    every document got the noise of the whole row's length (1.6x weaker for 4 documents of 5 to 20 tokens). Each
    token's noise now stays within its own document's ``alpha / sqrt(n * d)`` and reaches it."""
    import math

    import torch
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    rows = [{INPUT_IDS: torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (10, 20, 5, 7)]
    built, ids, noise, cuts = [], [], [], []

    def model_init():  # a new model when the run starts: the noise goes on the embeddings of the model it trains
        torch.manual_seed(0)
        model = from_preset("qwen3-next-tiny", vocab_size=128)
        embeddings = model.get_input_embeddings()
        model.register_forward_pre_hook(lambda module, args, kwargs: cuts.append(kwargs["cu_seq_lens_q"]),
                                        with_kwargs=True)
        embeddings.register_forward_pre_hook(lambda module, args: ids.append(args[0]))
        model.model.layers[0].register_forward_pre_hook(  # the embeddings as the first layer gets them
            lambda module, args: noise.append((args[0] - embeddings.weight[ids[-1]]).detach()))
        built.append(model)
        return model

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, neftune_noise_alpha=5.0, learning_rate=0.0)
    trainer = PackedTrainer(model_init=model_init, args=args, train_dataset=rows, lengths=[10, 20, 5, 7],
                            capacity=64, collator=PackingCollator(pad_to_multiple_of=16))
    trainer.train()
    embeddings = built[-1].get_input_embeddings()
    assert len(built) == 2 and trainer.model is built[-1]
    assert trainer.neftune_noise_alpha == 5.0 and not embeddings._forward_hooks  # its hook removed
    row = noise[-1][0].abs().amax(dim=-1)  # [T]: each token's largest noise
    width, start = embeddings.weight.shape[1], 0
    segments = cuts[-1].diff().tolist()
    assert sorted(segments) == [5, 6, 7, 10, 20]  # the documents and the padding to 48 tokens
    for n in segments:
        bound = 5.0 / math.sqrt(n * width)
        assert bool((row[start:start + n] <= bound * (1 + 1e-5)).all()) and row[start:start + n].max() > 0.9 * bound
        start += n
    assert start == row.numel()


def test_label_smoothing_shifts_the_labels_of_a_native_model(tmp_path) -> None:
    """transformers' ``Trainer`` shifts the labels for label smoothing only for the causal LMs it knows by name: a
    native model's smoothed loss compared each token's logits with its own token (3.73 where 4.92 is right). The
    loss is now each document's next-token cross-entropy with label smoothing."""
    import torch
    import torch.nn.functional as F
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny", vocab_size=128)
    rows = [{INPUT_IDS: torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (10, 20, 5, 7)]
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, label_smoothing_factor=0.1)
    trainer = PackedTrainer(model=model, args=args, train_dataset=rows, lengths=[10, 20, 5, 7], capacity=64)
    batch = PackingCollator()(rows)
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        logits = torch.cat([model(torch.tensor([r[INPUT_IDS]])).logits[0, :-1] for r in rows])
    targets = torch.cat([torch.tensor(r[INPUT_IDS][1:]) for r in rows])
    assert loss.item() == pytest.approx(F.cross_entropy(logits, targets, label_smoothing=0.1).item(), rel=1e-5)


def test_evaluation_and_prediction_collate_packed_rows(tmp_path) -> None:
    """``PackedTrainer`` gave its packing collator to training only: ``evaluate()`` stacked ragged examples with
    transformers' default collator and raised."""
    import torch
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny", vocab_size=128)
    rows = [{INPUT_IDS: torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (10, 20, 5, 7)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True)
    with torch.no_grad():
        expected = model(**PackingCollator()(rows)).loss.item()
    for collator in (None, PackingCollator(pack_length=32, max_documents=2)):  # 42 tokens of 4 documents
        trainer = PackedTrainer(model=model, args=args, train_dataset=rows, lengths=[10, 20, 5, 7], capacity=32,
                                eval_dataset=rows, collator=collator)
        assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, rel=1e-6)
        assert trainer.predict(rows).metrics["test_loss"] == pytest.approx(expected, rel=1e-6)


def test_a_resumed_moe_model_trains_on_from_its_saved_experts(tmp_path) -> None:
    """transformers 5 holds a MoE model's experts fused and writes them one by one; the ``Trainer`` loaded the
    checkpoint with ``load_state_dict(strict=False)``, which skipped them: the resumed run trained on from the
    experts it started with (2.8e-2 off the uninterrupted run). ``PackedTrainer`` loads such a checkpoint through
    the model's ``from_pretrained``."""
    import copy

    import torch
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.transformers.tiny import tiny_model
    from hybrid_pack.integrations.transformers.trainer import PackedTrainer, _renamed_on_disk

    torch.manual_seed(0)
    start = patch_model(tiny_model("qwen3_next"))
    rows = [{INPUT_IDS: torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (10, 20, 5, 7, 9, 13, 4, 11)]

    def run(model, out, resume=None):
        args = TrainingArguments(output_dir=str(out), max_steps=2, save_steps=1, report_to=[], use_cpu=True,
                                 learning_rate=1e-2, disable_tqdm=True)
        PackedTrainer(model=model, args=args, train_dataset=rows, lengths=[len(r[INPUT_IDS]) for r in rows],
                      capacity=32).train(resume_from_checkpoint=resume)
        return model

    whole = run(copy.deepcopy(start), tmp_path / "whole")
    assert _renamed_on_disk(whole, str(tmp_path / "whole" / "checkpoint-1"))  # the experts one by one
    dense = tiny_model("lfm2")  # a tied head stored once is no renaming
    dense.save_pretrained(tmp_path / "dense")
    assert dense.config.tie_word_embeddings and not _renamed_on_disk(dense, str(tmp_path / "dense"))
    resumed = run(copy.deepcopy(start), tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-1"))
    changed = False
    for (name, want), got, first in zip(whole.state_dict().items(), resumed.state_dict().values(),
                                        start.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
        changed |= "experts" in name and not torch.equal(want, first)
    assert changed  # the experts trained


@pytest.mark.parametrize("trainer_kind", ["packed", "plain"])
def test_the_guard_compares_noise_free_runs_under_neftune(tmp_path, trainer_kind: str) -> None:
    """NEFTune noises the embeddings of the training call; the guard compared that noisy call with documents run
    alone in eval mode (no noise) and raised a leak (0.885 off). It now runs the packed batch again in eval mode,
    as it does for dropout."""
    import torch
    from transformers import Trainer, TrainingArguments

    from hybrid_pack.integrations.transformers.guard import PackingGuardCallback
    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny", vocab_size=128)
    rows = [{INPUT_IDS: torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (10, 20, 5, 7)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, save_strategy="no", disable_tqdm=True, neftune_noise_alpha=5.0)
    guard = PackingGuardCallback(every=1)
    if trainer_kind == "packed":
        trainer = PackedTrainer(model=model, args=args, train_dataset=rows, lengths=[10, 20, 5, 7], capacity=64,
                                callbacks=[guard])
    else:  # transformers' own NEFTune hook
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=PackingCollator(),
                          callbacks=[guard])
    trainer.train()
    assert len(guard.guard.records) == 2 and all(record.ok for record in guard.guard.records)


def test_the_guard_checks_a_model_the_trainer_compiles(tmp_path) -> None:
    """``torch_compile=True`` compiles the model in place, hooks included: dynamo traced the guard's hooks and
    failed creating its guards (``AssertionError: Unexpected type``). The hooks now run between the graphs."""
    import torch
    from transformers import TrainingArguments

    from hybrid_pack.integrations.transformers.guard import PackingGuardCallback
    from hybrid_pack.integrations.transformers.trainer import PackedTrainer

    torch.manual_seed(0)
    model = from_preset("qwen3-next-tiny", vocab_size=128)
    rows = [{INPUT_IDS: torch.randint(0, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()}
            for n in (10, 20, 5, 7)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                             disable_tqdm=True, torch_compile=True)
    guard = PackingGuardCallback(every=1)
    PackedTrainer(model=model, args=args, train_dataset=rows, lengths=[10, 20, 5, 7], capacity=32,
                  callbacks=[guard]).train()
    assert len(guard.guard.records) == 1 and guard.guard.records[0].ok
