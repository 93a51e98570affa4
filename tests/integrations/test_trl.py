"""TRL's SFTTrainer on tiny hybrid models: documents kept apart on the path TRL trains on.

TRL replaces ``model.forward`` with a fused LM head that calls the backbone directly, so these tests
run the isolation harness on the trainer itself (``check_isolation(trainer)``: its ``compute_loss`` on its
first packed batch, per-token log-probs against each document alone, forward and gradient), with the
model patched before or after the trainer is built, with LoRA, gradient checkpointing and
``torch.compile``; and check :class:`~hybrid_pack.integrations.trl.PackedSFTTrainer`: TRL's packing or
hybrid_pack's through ``PackingCollator``, the loss of unpacked batches, extra columns kept.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install 'hybrid_pack[trl]')")
peft = pytest.importorskip("peft", reason="PEFT is not installed (pip install 'hybrid_pack[trl]')")

from datasets import Dataset  # noqa: E402

from hybrid_pack import PackingCollator  # noqa: E402
from hybrid_pack.cli import main as cli_main  # noqa: E402
from hybrid_pack.errors import InputError  # noqa: E402
from hybrid_pack.integrations.transformers import is_patched, patch_model  # noqa: E402
from hybrid_pack.integrations.transformers.tiny import VOCAB, tiny_model, tiny_tokenizer  # noqa: E402
from hybrid_pack.integrations.trl import TRL_SEQ_LENGTHS, PackedRowsCollator, PackedSFTTrainer  # noqa: E402
from hybrid_pack.schema import ADVANTAGES, CU_SEQ_LENS_Q, IGNORE_INDEX, INPUT_IDS, LABELS  # noqa: E402
from hybrid_pack.testing import check_isolation, check_training_step  # noqa: E402
from tests.support.torch_path import pure_torch_transformers  # noqa: E402

FAMILIES = ["qwen3_next", "bamba", "jamba"]
DOC_LENGTHS = [5, 9, 3, 12, 7, 4, 6, 2, 20, 11, 8, 1]
DOCS = Path(__file__).parents[2] / "docs" / "trl.md"
MEASUREMENT = Path(__file__).parents[2] / "benchmarks" / "trl_sft_unpatched.py"


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def _texts() -> Dataset:
    words = [" ".join(f"w{3 + (7 * i + j) % (VOCAB - 3)}" for j in range(n)) for i, n in enumerate(DOC_LENGTHS)]
    return Dataset.from_dict({"text": words})


def _config(out: Path, **overrides: Any) -> Any:
    settings = {"output_dir": str(out), "per_device_train_batch_size": 2, "max_length": 32, "packing": True,
                "max_steps": 1, "learning_rate": 1e-3, "use_cpu": True, "bf16": False, "report_to": [],
                "save_strategy": "no", "disable_tqdm": True, "logging_steps": 1, "dataset_num_proc": None}
    return trl.SFTConfig(**{**settings, **overrides})


def _assert_isolated_on_the_fused_path(trainer: Any) -> None:
    report = check_isolation(trainer)
    assert report.ok and report.error is None, str(report)
    assert report.layouts[0].name == "training step: per-token log_probs", str(report)
    assert len(report.documents) > 2
    assert max(d.alone_diff for d in report.documents) < 1e-6, str(report)
    assert all(d.gradient_leak == 0.0 for d in report.documents), str(report)


# ---------------------------------------------------------------- SFTTrainer with TRL's own collator


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("family", FAMILIES)
def test_sft_trainer_keeps_documents_apart(family: str, order: str, tmp_path: Path) -> None:
    """TRL's packing and padding-free collator, the model patched before or after ``SFTTrainer(...)``; one
    training step (gradient checkpointing on, TRL's default), then the harness on the trainer."""
    model = tiny_model(family).train()
    if order == "before":
        patch_model(model)
    trainer = trl.SFTTrainer(model=model, args=_config(tmp_path), train_dataset=_texts(),
                             processing_class=tiny_tokenizer())
    if order == "after":
        patch_model(trainer.model)
    assert torch.isfinite(torch.tensor(trainer.train().training_loss))
    assert trainer.model.is_gradient_checkpointing
    _assert_isolated_on_the_fused_path(trainer)


def test_harness_on_the_trainer_catches_a_silent_leak(tmp_path: Path) -> None:
    """Unpatched Jamba trains on TRL's packed rows without an error while its Mamba layers carry state across
    documents (they never receive ``seq_idx``); the harness pointed at the trainer must say so."""
    trainer = trl.SFTTrainer(model=tiny_model("jamba").train(), args=_config(tmp_path), train_dataset=_texts(),
                             processing_class=tiny_tokenizer())
    report = check_isolation(trainer)
    assert not report.ok and report.error is None, str(report)
    assert report.layouts[0].name == "training step: per-token log_probs"
    assert max(d.gradient_leak for d in report.documents) > 1e-4, str(report)
    assert report.first_leaking_module.startswith("model.layers."), str(report)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_the_patched_model_keeps_documents_apart(family: str, tmp_path: Path) -> None:
    model = patch_model(tiny_model(family).train())
    lora = peft.LoraConfig(r=4, target_modules=["in_proj", "in_proj_qkvz", "q_proj", "v_proj"])
    trainer = trl.SFTTrainer(model=model, args=_config(tmp_path), train_dataset=_texts(),
                             processing_class=tiny_tokenizer(), peft_config=lora)
    assert isinstance(trainer.model, peft.PeftModel)
    trainer.train()
    _assert_isolated_on_the_fused_path(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_torch_compile_keeps_documents_apart(family: str, tmp_path: Path) -> None:
    """``torch_compile=True``: accelerate compiles the model when training starts; the harness then runs the
    compiled model (``trainer.model_wrapped``). Dynamo starts afresh, as in a new process: after earlier tests'
    compiles, the MoE router logits (which transformers records through a ContextVar, which dynamo does not
    trace) came back empty and TRL's auxiliary loss failed on the empty tuple (transformers 5.24, TRL 1.16)."""
    torch._dynamo.reset()
    model = patch_model(tiny_model(family).train())
    config = _config(tmp_path, torch_compile=True, torch_compile_backend="eager", per_device_train_batch_size=1)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=_texts(), processing_class=tiny_tokenizer())
    trainer.train()
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    _assert_isolated_on_the_fused_path(trainer)


# ---------------------------------------------------------------- PackedSFTTrainer


@pytest.mark.parametrize("packing", ["trl", "hybrid_pack"])
@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_packed_sft_trainer_trains_leak_free(family: str, packing: str, tmp_path: Path) -> None:
    """TRL's packing (BFD rows with ``seq_lengths``) or hybrid_pack's (``capacity``), through PackingCollator."""
    config = _config(tmp_path, packing=packing == "trl", max_steps=3)
    capacity = None if packing == "trl" else 52        # two packs of several documents each
    trainer = PackedSFTTrainer(model=tiny_model(family).train(), args=config, train_dataset=_texts(),
                               processing_class=tiny_tokenizer(), capacity=capacity)
    assert is_patched(trainer.model)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch[INPUT_IDS].shape[0] == 1 and CU_SEQ_LENS_Q in batch
    if packing == "hybrid_pack":
        assert batch[INPUT_IDS].shape[1] <= capacity
    _assert_isolated_on_the_fused_path(trainer)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    _assert_isolated_on_the_fused_path(trainer)


def test_packing_collator_follows_trl_seq_lengths(tmp_path: Path) -> None:
    trainer = PackedSFTTrainer(model=tiny_model("bamba"), args=_config(tmp_path), train_dataset=_texts(),
                               processing_class=tiny_tokenizer())
    rows = [trainer.train_dataset[i] for i in range(2)]
    batch = trainer.data_collator(rows)
    lengths = [n for row in rows for n in row[TRL_SEQ_LENGTHS]]
    expected = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    torch.testing.assert_close(batch[CU_SEQ_LENS_Q], expected)
    torch.testing.assert_close(batch[INPUT_IDS][0], torch.tensor([t for row in rows for t in row[INPUT_IDS]]))
    assert (batch[LABELS][0, expected[:-1].long()] == IGNORE_INDEX).all()


def _documents_of(rows: list[dict]) -> list[dict]:
    """TRL rows split into their documents (one document per row without ``seq_lengths``)."""
    return [doc for row in rows for doc in PackedRowsCollator().documents(row)]


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_packed_loss_and_gradients_equal_unpacked(family: str, packing: bool, tmp_path: Path) -> None:
    """The same examples and weights: TRL's padded batch of the documents, and PackedSFTTrainer's packed row,
    give the same loss and gradients, with and without ``num_items_in_batch`` (gradient accumulation)."""
    packed_trainer = PackedSFTTrainer(model=tiny_model(family).train(), args=_config(tmp_path, packing=packing),
                                      train_dataset=_texts(), processing_class=tiny_tokenizer())
    padded_trainer = trl.SFTTrainer(model=tiny_model(family).train(), args=_config(tmp_path, packing=False),
                                    train_dataset=_texts(), processing_class=tiny_tokenizer())
    rows = [packed_trainer.train_dataset[i] for i in range(3)]
    documents = [{key: doc[key] for key in (INPUT_IDS, LABELS)} for doc in _documents_of(rows)]
    packed_batch, padded_batch = packed_trainer.data_collator(rows), padded_trainer.data_collator(documents)
    assert packed_batch[INPUT_IDS].shape[0] == 1 and padded_batch[INPUT_IDS].shape[0] == len(documents) >= 3
    num_items = int((padded_batch[LABELS][:, 1:] != IGNORE_INDEX).sum())
    for trainer in (packed_trainer, padded_trainer):
        trainer.current_gradient_accumulation_steps = 1     # set by train(); the MoE aux loss divides by it
    for items in (None, 2 * num_items):
        results = []
        for trainer, batch in ((packed_trainer, packed_batch), (padded_trainer, padded_batch)):
            trainer.model.zero_grad()
            with pure_torch_transformers(trainer.model):
                loss = trainer.compute_loss(trainer.model, trainer._prepare_inputs(dict(batch)),
                                            num_items_in_batch=items)
                loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in trainer.model.parameters()]))
        (packed_loss, packed_grads), (padded_loss, padded_grads) = results
        torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
        for packed_grad, padded_grad in zip(packed_grads, padded_grads, strict=True):
            torch.testing.assert_close(packed_grad, padded_grad, rtol=1e-4, atol=1e-6)


def test_extra_token_columns_survive_trl_column_handling(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in DOC_LENGTHS]
    dataset = Dataset.from_dict({INPUT_IDS: ids, ADVANTAGES: [[float(i)] * len(x) for i, x in enumerate(ids)],
                                 "source": [f"doc {i}" for i in range(len(ids))]})
    trainer = PackedSFTTrainer(model=tiny_model("bamba"), args=_config(tmp_path, packing=False),
                               train_dataset=dataset, processing_class=tiny_tokenizer(), capacity=40)
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch[ADVANTAGES].shape == batch[INPUT_IDS].shape and batch[ADVANTAGES].dtype == torch.float32
    starts = batch[CU_SEQ_LENS_Q][:-1].long()
    for start, end in zip(starts.tolist(), batch[CU_SEQ_LENS_Q][1:].tolist(), strict=True):
        assert batch[ADVANTAGES][0, start:end].unique().numel() == 1     # one value per document, in place


def test_packed_sft_trainer_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    arguments = {"model": tiny_model("bamba"), "train_dataset": _texts(), "processing_class": tiny_tokenizer()}
    with pytest.raises(InputError, match="data_collator: PackedSFTTrainer collates with hybrid_pack.PackingCollator"):
        PackedSFTTrainer(args=_config(tmp_path), data_collator=lambda rows: rows, **arguments)
    with pytest.raises(InputError, match="capacity: .*set packing=False"):
        PackedSFTTrainer(args=_config(tmp_path), capacity=64, **arguments)
    # TRL's wrapped packing records no document lengths: its rows were taken for one document each, silently
    with pytest.raises(InputError, match="packing_strategy: 'wrapped' cuts documents"):
        PackedSFTTrainer(args=_config(tmp_path, packing_strategy="wrapped"), **arguments)
    with pytest.raises(InputError, match="packing_strategy: 'wrapped' cuts documents"):  # the evaluation set's
        PackedSFTTrainer(args=_config(tmp_path, packing=False, eval_packing=True, packing_strategy="wrapped"),
                         eval_dataset=_texts(), **arguments)
    # the longest example is 20 tokens: the error named an overflow= the trainer does not take
    with pytest.raises(InputError, match=r"capacity: example \d+ has \d+ tokens, more than capacity=8 .*"
                                         r"SFTConfig\(max_length=8\)"):
        PackedSFTTrainer(args=_config(tmp_path, packing=False, max_length=None), capacity=8, **arguments)
    with pytest.raises(InputError, match=r"rows\[0\]\.seq_lengths: expected positive lengths summing to .* 5 tokens"):
        PackedRowsCollator()([{INPUT_IDS: [3, 4, 5, 6, 7], TRL_SEQ_LENGTHS: [2, 2]}])
    trainer = PackedSFTTrainer(args=_config(tmp_path), data_collator=PackingCollator(pad_to_multiple_of=16),
                               **arguments)
    assert trainer.data_collator([trainer.train_dataset[0]])[INPUT_IDS].shape[1] % 16 == 0


# ---------------------------------------------------------------- router auxiliary loss


def test_router_aux_loss_couples_documents_by_design(tmp_path: Path) -> None:
    """A MoE load-balancing loss is a product of batch means: each document's loss then has a gradient on the
    others' tokens. The per-token log-probs stay isolated; without the aux loss, so does the whole loss."""
    reports = {}
    for coef in (None, 0.0):           # None: the config's router_aux_loss_coef (0.001 for Qwen3-Next)
        trainer = PackedSFTTrainer(model=tiny_model("qwen3_next"), args=_config(tmp_path, router_aux_loss_coef=coef),
                                   train_dataset=_texts(), processing_class=tiny_tokenizer())
        assert trainer.aux_loss_enabled is (coef is None)
        reports[coef] = (check_training_step(trainer), check_training_step(trainer, per_token=False, per_layer=False))
    (with_aux_tokens, with_aux_loss), (without_tokens, without_loss) = reports[None], reports[0.0]
    assert with_aux_tokens.ok and without_tokens.ok and without_loss.ok, str(without_loss)
    assert all(d.gradient_leak == 0.0 for d in without_loss.documents)
    assert not with_aux_loss.ok and 0 < max(d.gradient_leak for d in with_aux_loss.documents) < 1e-4, str(with_aux_loss)


# ---------------------------------------------------------------- docs/trl.md


@pytest.mark.slow
def test_docs_measurement_prints_the_table(tmp_path: Path) -> None:
    """docs/trl.md's measuring script (benchmarks/trl_sft_unpatched.py) runs and prints the leak the page shows:
    unpatched models raise or leak, PackedSFTTrainer does not, packed and padded losses agree."""
    run = subprocess.run([sys.executable, str(MEASUREMENT)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "benchmarks/trl_sft_unpatched.py" in DOCS.read_text()
    lines = run.stdout.splitlines()
    assert lines[0].startswith("qwen3_next: unpatched: raises ValueError; guard bypassed: log-probs differ by ")
    assert lines[2].startswith("bamba: unpatched: raises ValueError; guard bypassed: log-probs differ by ")
    assert lines[4].startswith("jamba: unpatched: log-probs differ by ")
    for line in (lines[0], lines[2], lines[4]):
        assert line.endswith("PackedSFTTrainer: log-probs differ by 0, gradient 0") or \
            re.search(r"PackedSFTTrainer: log-probs differ by [0-9.]+e-0[7-9], gradient 0$", line), line
    for line in (lines[1], lines[3]):
        packed, padded = (float(x) for x in re.findall(r"loss (\d\.\d+)", line))
        assert abs(packed - padded) < 1e-5, line


def test_cli_check_runs_on_a_trainer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``hybrid-pack check --trainer FILE.py:FUNCTION``: the harness on the trainer the function builds."""
    script = tmp_path / "make_trainer.py"
    script.write_text(
        "import trl\n"
        "from datasets import Dataset\n"
        "from hybrid_pack.integrations.transformers import patch_model\n"
        "from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer\n\n"
        "def build(patched):\n"
        "    model = tiny_model('jamba').train()\n"
        "    if patched:\n"
        "        patch_model(model)\n"
        f"    texts = Dataset.from_dict({{'text': {list(_texts()['text'])!r}}})\n"
        f"    args = trl.SFTConfig(output_dir={str(tmp_path / 'out')!r}, per_device_train_batch_size=2, max_length=32,"
        " packing=True, max_steps=1, use_cpu=True, bf16=False, report_to=[], dataset_num_proc=None)\n"
        "    return trl.SFTTrainer(model=model, args=args, train_dataset=texts, processing_class=tiny_tokenizer())\n\n"
        "def patched():\n    return build(True)\n\n"
        "def unpatched():\n    return build(False)\n")
    assert cli_main(["check", "--trainer", f"{script}:patched"]) == 0
    assert "ISOLATED" in capsys.readouterr().out
    assert cli_main(["check", "--trainer", f"{script}:unpatched"]) == 1
    assert "LEAK" in capsys.readouterr().out
    assert cli_main(["check", "--trainer", f"{script}:missing"]) == 2


@pytest.mark.parametrize(("data", "settings", "message"), [
    ("text", {"packing": True, "max_length": 16},
     r"TRL cut 5 tokens from the 1 of 12 examples longer than max_length=16 \(packing_strategy='bfd_split' keeps"),
    ("text", {"packing": False, "max_length": 8}, "TRL cut 25 tokens from the 5 of 12 examples longer than "
     "max_length=8$"),
    ("prompt_completion", {"packing": False, "max_length": 3}, r"longer than max_length=3, then dropped \d+ examples "
     "left without a label"),
    ("text", {"packing": True, "max_length": 16, "packing_strategy": "bfd_split"}, None),
], ids=["bfd", "truncated", "dropped", "bfd_split"])
def test_what_trl_cuts_from_the_dataset_is_counted_and_shown(data: str, settings: dict, message: str | None,
                                                             tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    """TRL truncates examples to max_length (and drops those left without a label) without a word; the packed
    trainer prepares exactly TRL's dataset and says how much was cut."""
    dataset = _texts()
    if data == "prompt_completion":
        texts = dataset["text"]
        dataset = Dataset.from_dict({"prompt": [t[:12] for t in texts], "completion": [t[12:] + " w5" for t in texts]})
    config = _config(tmp_path, **settings)
    plain = trl.SFTTrainer(model=tiny_model("bamba"), args=config, train_dataset=dataset,
                           processing_class=tiny_tokenizer())
    with caplog.at_level(logging.WARNING, logger="hybrid_pack.integrations.trl"):
        packed = PackedSFTTrainer(model=tiny_model("bamba"), args=config, train_dataset=dataset,
                                  processing_class=tiny_tokenizer())
    assert packed.train_dataset.to_list() == plain.train_dataset.to_list()
    said = [r.getMessage() for r in caplog.records if r.name == "hybrid_pack.integrations.trl"]
    if message is None:
        assert not said
    else:
        assert len(said) == 1 and re.search(message, said[0]), said


def test_a_resumed_moe_model_trains_on_from_its_saved_experts(tmp_path: Path) -> None:
    """TRL's trainers resume through transformers' ``Trainer``, which skipped a MoE model's experts (held fused,
    written one by one): the resumed run went on from the experts it started with. Every packed trainer loads such
    a checkpoint through the model's ``from_pretrained`` (``ResumesRenamedWeights``)."""
    import copy

    from hybrid_pack.integrations.transformers.trainer import ResumesRenamedWeights
    from hybrid_pack.integrations.trl import PackedDPOTrainer, PackedGRPOTrainer, PackedRLOOTrainer

    assert all(issubclass(trainer, ResumesRenamedWeights)
               for trainer in (PackedSFTTrainer, PackedDPOTrainer, PackedGRPOTrainer, PackedRLOOTrainer))
    start = tiny_model("qwen3_next")

    def run(out: Path, resume: str | None = None) -> Any:
        model = copy.deepcopy(start)
        trainer = PackedSFTTrainer(model=model, args=_config(out, max_steps=2, save_strategy="steps", save_steps=1,
                                                             learning_rate=1e-2),
                                   train_dataset=_texts(), processing_class=tiny_tokenizer())
        trainer.train(resume_from_checkpoint=resume)
        return model

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-1"))
    trained = False
    for (name, want), got, first in zip(whole.state_dict().items(), resumed.state_dict().values(),
                                        start.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
        trained |= "experts" in name and not torch.equal(want, first)
    assert trained
