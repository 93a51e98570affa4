"""The harness on a training step and its real batch: every leaky mixer of the zoo is flagged and named on
the step's own path (logits, log-probs of a custom head, or only its loss), a clean model never is, and
the check leaves a trainer as it found it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hybrid_pack import PackedBoundaries, PackingCollator
from hybrid_pack.errors import InputError
from hybrid_pack.loss import packed_loss, token_logprobs
from hybrid_pack.schema import INPUT_IDS, LABELS
from hybrid_pack.testing import TOLERANCE, check_isolation, check_training_step
from tests.testing.leaky_zoo import LEAKY, ToyLM, clean_mixers

DIM = 16
LENGTHS = [5, 9, 1, 17, 3]


def _model(mixers: list) -> ToyLM:
    torch.manual_seed(0)
    return ToyLM(mixers, dim=DIM).double()


def _batch(lengths: list[int] = LENGTHS) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    return PackingCollator()([{INPUT_IDS: torch.randint(0, 37, (n,), generator=generator)} for n in lengths])


def _logprob_step(model: ToyLM) -> Any:
    """A custom head that calls the blocks directly and returns per-token log-probs ``[1, T]``, as TRL's fused LM
    head does (the model's own forward never runs)."""

    def step(batch: dict[str, Any]) -> torch.Tensor:
        x, boundaries = model.embed(batch[INPUT_IDS]), PackedBoundaries.from_batch(batch)
        for block in model.blocks:
            x = block(x, boundaries)
        return token_logprobs(model.head(x), batch[LABELS])[0]

    return step


def _loss_step(model: ToyLM) -> Any:
    return lambda batch: packed_loss(model(**batch).logits, batch[LABELS])


def test_clean_model_passes_on_every_kind_of_step() -> None:
    model = _model(clean_mixers(DIM))
    reports = {"logits": check_isolation(model, batch=_batch()),
               "log-probs": check_training_step(_logprob_step(model), _batch(), model=model),
               "loss": check_training_step(_loss_step(model), _batch(), model=model, per_token=False)}
    for kind, report in reports.items():
        assert report.ok and report.error is None, f"{kind}:\n{report}"
        assert [d.length for d in report.documents] == LENGTHS
    assert reports["logits"].layouts[0].name == "training step: per-token logits"
    assert reports["log-probs"].layouts[0].name == "training step: per-token values"
    assert reports["loss"].layouts[0].name == "training step: per-document loss"
    assert all(d.gradient_leak == 0.0 for report in reports.values() for d in report.documents)


@pytest.mark.parametrize("name", sorted(LEAKY))
def test_leaky_mixer_is_flagged_and_named_on_the_step(name: str) -> None:
    build, module = LEAKY[name]
    model = _model(build(DIM))
    report = check_isolation(model, batch=_batch())
    assert not report.ok and report.error is None, f"{name} was not flagged:\n{report}"
    assert report.first_leaking_module == module, str(report)
    if name == "leak only in the backward pass":
        return                  # invisible to next-token targets: see the test below
    by_values = check_training_step(_logprob_step(model), _batch(), model=model, per_layer=False)
    by_loss = check_training_step(_loss_step(model), _batch(), model=model, per_token=False, per_layer=False)
    assert not by_values.ok and not by_loss.ok, f"{name} was not flagged on every step:\n{by_values}\n{by_loss}"


def test_backward_only_leak_is_judged_by_what_trains() -> None:
    """The zoo's backward leak moves each token's gradient one token later. The logits of a document's last
    token reach the next document, so a check on logits catches it (in the backward pass only). A next-token
    loss never uses those logits (the next document's first label is -100), so on such a step the leak moves
    no gradient across documents, and the step is rightly passed."""
    build, _ = LEAKY["leak only in the backward pass"]
    model = _model(build(DIM))
    on_logits = check_isolation(model, batch=_batch())
    assert all(d.alone_diff <= on_logits.atol for d in on_logits.documents)
    assert max(d.gradient_leak for d in on_logits.documents) > 0 and on_logits.layouts[0].leak_kind == "backward"
    on_loss = check_training_step(_loss_step(model), _batch(), model=model, per_token=False)
    assert on_loss.ok and all(d.gradient_leak == 0.0 for d in on_loss.documents), str(on_loss)


def test_a_step_that_raises_is_reported_not_passed() -> None:
    def step(batch: dict[str, Any]) -> torch.Tensor:
        raise RuntimeError("kernel cannot take cu_seqlens")

    report = check_training_step(step, _batch(), model=_model(clean_mixers(DIM)))
    assert not report.ok and report.error == "RuntimeError: kernel cannot take cu_seqlens"


def test_bad_arguments_are_refused() -> None:
    model = _model(clean_mixers(DIM))
    with pytest.raises(InputError, match="model: pass the module the step runs"):
        check_training_step(_loss_step(model), _batch())
    with pytest.raises(InputError, match="batch: a training step is checked on its real packed batch"):
        check_training_step(model)
    with pytest.raises(InputError, match=r"batch: expected one packed row \(input_ids \[1, T\]\)"):
        check_isolation(model, batch={INPUT_IDS: torch.zeros(2, 8, dtype=torch.long)})
    with pytest.raises(InputError, match="per_token: the step's model returned no per-token"):
        check_training_step(_loss_step(model), _batch(), model=torch.nn.Identity(), per_token=True)
    without_labels = {k: v for k, v in _batch().items() if k != LABELS}
    with pytest.raises(InputError, match="batch: judging per-document losses needs labels"):
        check_training_step(model, without_labels, per_token=False)


class _Trainer:
    """The parts of a ``transformers.Trainer`` the harness uses, with TRL-like bookkeeping."""

    def __init__(self, model: ToyLM) -> None:
        self.model = model
        self.model_wrapped = model
        self.total_tokens = 0
        self.metrics: dict[str, list[float]] = {"loss": []}

    def get_train_dataloader(self) -> Iterator[dict[str, Any]]:
        torch.rand(1)                                   # a sampler drawing from the global generator
        return iter([_batch()])

    def _prepare_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    def compute_loss_context_manager(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def compute_loss(self, model: ToyLM, inputs: dict[str, Any]) -> torch.Tensor:
        loss = packed_loss(model(**inputs).logits, inputs[LABELS])
        self.total_tokens += inputs[INPUT_IDS].shape[1]
        self.metrics["loss"].append(loss.item())
        return loss


def test_a_trainer_is_checked_on_its_first_batch_and_left_as_it_was() -> None:
    trainer = _Trainer(_model(clean_mixers(DIM)))
    head = trainer.model.head.weight
    head.grad = torch.ones_like(head)
    state = torch.get_rng_state()
    report = check_isolation(trainer)
    assert report.ok and report.model == "_Trainer(ToyLM)" and len(report.documents) == len(LENGTHS), str(report)
    assert trainer.total_tokens == 0 and trainer.metrics == {"loss": []}
    assert torch.equal(head.grad, torch.ones_like(head)) and torch.equal(torch.get_rng_state(), state)
    assert trainer.model.training is True           # the mode it had (ToyLM starts in training mode)


def test_a_step_under_autocast_is_judged_at_its_precision() -> None:
    model = _model(clean_mixers(DIM)).float()

    def bf16_step(batch: dict[str, Any]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(**batch).logits

    plain = check_training_step(lambda batch: model(**batch).logits, _batch(), model=model)
    lowered = check_training_step(bf16_step, _batch(), model=model)
    assert plain.atol == TOLERANCE[torch.float32]
    assert lowered.atol == TOLERANCE[torch.bfloat16] and lowered.ok, str(lowered)
