"""PackedRLOOTrainer: one step equals ``trl.RLOOTrainer``'s (TRL's RLOO has GRPO's log-probability method).

TRL's RLOO has no ``rollout_func``; both trainers generate from the same tiny model with the same seed, so they
sample the same completions (checked: the logged completion lengths agree). The reference is TRL's trainer on the
unpatched model; the packed one must give the same log-probabilities of the policy and the reference model, the
same loss and the same parameters after one SGD step, every forward of its log-probability method a packed row.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install 'hybrid_pack[trl]')")

from datasets import Dataset  # noqa: E402

from hybrid_pack.integrations import trl_grpo  # noqa: E402
from hybrid_pack.integrations.transformers import is_patched  # noqa: E402
from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer  # noqa: E402
from hybrid_pack.integrations.trl import PackedRLOOTrainer  # noqa: E402
from hybrid_pack.integrations.trl_grpo import _real_lengths as real_lengths  # noqa: E402
from hybrid_pack.schema import CU_SEQ_LENS_Q, INPUT_IDS  # noqa: E402
from tests.support.torch_path import pure_torch_transformers  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def _reward(completions: list[str], **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def _train(trainer_class: type, tmp_path: Path, **extra: Any) -> tuple[Any, list[Any], list[Any]]:
    path = tmp_path / "model"
    if not (path / "config.json").exists():
        tiny_model("bamba").save_pretrained(path)
    model = tiny_model("bamba").train()
    model.config._name_or_path = str(path)                # TRL loads the reference model from there (beta > 0)
    args = trl.RLOOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                          steps_per_generation=2, max_completion_length=8, max_steps=1, learning_rate=0.1,
                          optim="sgd", beta=0.1, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                          disable_tqdm=True, logging_steps=1, seed=0)
    trainer = trainer_class(model=model, reward_funcs=_reward, args=args,
                            train_dataset=Dataset.from_dict({"prompt": ["w3 w4 w5 w6 w7", "w9 w10"] * 4}),
                            processing_class=tiny_tokenizer(), **extra)
    results: list[Any] = []
    method = trainer._get_per_token_logps_and_entropies

    def recorded(*args: Any, **kwargs: Any) -> Any:
        out = method(*args, **kwargs)
        results.append(out[0].detach().clone())
        return out

    trainer._get_per_token_logps_and_entropies = recorded
    forwards: list[tuple[tuple[int, ...], bool]] = []
    for module in filter(None, (trainer.model, trainer.ref_model)):
        module.register_forward_pre_hook(
            lambda _m, _a, kw: forwards.append((tuple(kw[INPUT_IDS].shape), CU_SEQ_LENS_Q in kw)), with_kwargs=True,
            prepend=True)
    with pure_torch_transformers(model):
        trainer.train()
    return trainer, results, forwards


def test_one_step_equals_trl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, expected, _ = _train(trl.RLOOTrainer, tmp_path)
    mask_reads: list[int] = []
    monkeypatch.setattr(trl_grpo, "_real_lengths", lambda *args: mask_reads.append(1) or real_lengths(*args))
    packed, got, forwards = _train(PackedRLOOTrainer, tmp_path, packing_capacity=16)
    assert mask_reads == [], "a log-probability call read the attention mask (the lengths come with the batch)"
    assert is_patched(packed.model) and not is_patched(reference.model)
    want_log, got_log = reference.state.log_history[0], packed.state.log_history[0]
    assert want_log["completions/mean_length"] == got_log["completions/mean_length"]    # the same generations

    assert len(got) == len(expected) >= 2
    for want, logps in zip(expected, got, strict=True):
        torch.testing.assert_close(logps, want, rtol=0, atol=1e-5)
        assert torch.equal(logps == 0, want == 0)
    torch.testing.assert_close(got_log["loss"], want_log["loss"], rtol=0, atol=1e-5)
    for (name, want), (_, param) in zip(reference.model.named_parameters(), packed.model.named_parameters(),
                                        strict=True):
        torch.testing.assert_close(param, want, rtol=0, atol=1e-5, msg=name)
    scoring = [f for f in forwards if f[1]]
    assert scoring and all(shape[0] == 1 and shape[1] <= 16 for shape, _ in scoring)
