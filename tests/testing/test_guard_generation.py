"""The guard tells generation from training (issue 34): decode calls are neither checked nor counted as unpacked.

An RL trainer generates with the policy itself, in training mode and without gradient: ``model.generate``'s
prefill and decode calls carry a cache (or ``use_cache``) and run inside transformers' generation code. They are
no training calls. The packed log-probability calls of ``PackedGRPOTrainer`` also run without gradient, but with
no cache and outside ``generate``: those are checked. A trainer that never packs is still reported.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hybrid_pack import PackingCollator
from hybrid_pack.errors import UncheckedError
from hybrid_pack.schema import CACHE_KEYS, INPUT_IDS, USE_CACHE
from hybrid_pack.testing import IsolationWarning, PackingGuard

pytest.importorskip("transformers", reason="transformers is not installed (pip install 'hybrid_pack[hf]')")

from hybrid_pack.integrations.transformers import patch_model
from hybrid_pack.integrations.transformers.tiny import VOCAB, tiny_model
from tests.support.torch_path import pure_torch_transformers

EOS = 1


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return patch_model(tiny_model("qwen3_next"))


def _packed_row(lengths: list[int] = [5, 9, 3]) -> dict[str, Any]:  # noqa: B006
    g = torch.Generator().manual_seed(0)
    features = [{INPUT_IDS: torch.randint(3, VOCAB, (n,), generator=g).tolist()} for n in lengths]
    return PackingCollator()(features)


def _generate(model: torch.nn.Module, new_tokens: int, **settings: Any) -> torch.Tensor:
    """Sample ``new_tokens`` tokens for two left-padded prompts, in training mode without gradient (as TRL does)."""
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    attention_mask = (prompts != 0).long()
    with torch.no_grad(), pure_torch_transformers(model):
        return model.generate(input_ids=prompts, attention_mask=attention_mask, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=True, pad_token_id=0, eos_token_id=EOS,
                              **settings)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
def test_generate_in_training_mode_is_not_a_training_call(model: torch.nn.Module, use_cache: bool) -> None:
    """``model.generate`` in training mode (its prefill and every decode step): nothing counted, nothing said,
    with or without a cache (without one, the calls are known by running inside transformers' generation code)."""
    calls: list[dict[str, Any]] = []
    handle = model.register_forward_pre_hook(lambda _m, _a, kwargs: calls.append(kwargs), with_kwargs=True)
    model.train()
    try:
        with PackingGuard(model, every=1) as guard:
            _generate(model, 12, use_cache=use_cache)
    finally:
        handle.remove()
    assert len(calls) >= 12                                   # the guard saw every decode step
    assert any(calls[-1].get(key) is not None for key in CACHE_KEYS) == use_cache
    assert guard.calls == 0 and guard.unpacked_calls == 0 and guard.records == []


def test_decode_call_with_a_cache_is_not_counted_but_a_training_call_with_one_is(model: torch.nn.Module) -> None:
    """The call alone decides, whoever makes it: no gradient and a cache (or ``use_cache=True``) is a decode call;
    with gradient, a cache is a training input (prefix tuning), so that call still counts."""
    from transformers import DynamicCache

    model.train()
    ids = torch.randint(3, VOCAB, (2, 6))
    guard = PackingGuard(model, every=100, action="warn").attach()
    with pure_torch_transformers(model):
        with torch.no_grad():
            model(input_ids=ids, **{USE_CACHE: True})
            model(input_ids=ids, cache=DynamicCache(config=model.config))
        assert guard.unpacked_calls == 0
        model(input_ids=ids, **{USE_CACHE: True}).logits.sum().backward()
    model.zero_grad(set_to_none=True)
    assert guard.unpacked_calls == 1
    with pytest.warns(IsolationWarning, match="1 training calls, none of them a packed row"):
        guard.detach()


def test_packed_scoring_without_gradient_is_checked_between_generations(model: torch.nn.Module) -> None:
    """An RL step: generate, then score the completions on a packed row under ``no_grad`` (the old policy's
    log-probabilities), then the packed training forward. Both packed calls are checked; generation is not counted."""
    row = _packed_row()
    model.train()
    with PackingGuard(model, every=1) as guard:
        _generate(model, 8)
        with torch.no_grad(), pure_torch_transformers(model):
            model(**row, **{USE_CACHE: False})                # packed scoring, no gradient, no cache
        _generate(model, 8)
        with pure_torch_transformers(model):
            model(**row).loss.backward()
    model.zero_grad(set_to_none=True)
    assert guard.calls == 2 and guard.unpacked_calls == 0
    assert [record.call for record in guard.records] == [0, 1] and all(record.ok for record in guard.records)


def test_a_trainer_that_generates_and_never_packs_is_still_reported(model: torch.nn.Module) -> None:
    """Generation is left out, the padded scoring calls are not: after ``every`` of them the guard raises."""
    padded = torch.randint(3, VOCAB, (2, 13))
    model.train()
    guard = PackingGuard(model, every=2).attach()
    try:
        _generate(model, 8)
        with torch.no_grad(), pure_torch_transformers(model):
            model(input_ids=padded, attention_mask=torch.ones_like(padded))
            with pytest.raises(UncheckedError, match=r"2 training calls, none of them.*input_ids \[2, 13\]"):
                model(input_ids=padded, attention_mask=torch.ones_like(padded))
    finally:
        guard.detach()


# ------------------------------------------------------------------ TRL's GRPO, generating with model.generate
@pytest.fixture
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def _grpo(tmp_path: Path, every: int, packed: bool = True) -> tuple[Any, Any]:
    """One GRPO step with real generation (``model.generate``, 16 tokens per completion, EOS held back; the old
    policy's log-probabilities computed, as ``steps_per_generation=2`` asks) and ``PackingGuardCallback(every)``."""
    trl = pytest.importorskip("trl", reason="TRL is not installed (pip install 'hybrid_pack[trl]')")
    from datasets import Dataset

    from hybrid_pack.integrations.transformers.guard import PackingGuardCallback
    from hybrid_pack.integrations.transformers.tiny import tiny_tokenizer
    from hybrid_pack.integrations.trl import PackedGRPOTrainer

    model = tiny_model("qwen3_next").train()
    callback = PackingGuardCallback(every=every)
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, steps_per_generation=2,
                          num_generations=4, max_completion_length=16, generation_kwargs={"min_new_tokens": 16},
                          max_steps=1, beta=0.0, use_cpu=True, bf16=False, report_to=[], save_strategy="no",
                          disable_tqdm=True, logging_steps=1, seed=0)
    trainer_class = PackedGRPOTrainer if packed else trl.GRPOTrainer
    trainer = trainer_class(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                            args=args, train_dataset=Dataset.from_dict({"prompt": ["w3 w4 w5 w6 w7", "w9 w10"] * 2}),
                            processing_class=tiny_tokenizer(), callbacks=[callback])
    with pure_torch_transformers(model):
        trainer.train()
    return trainer, callback


@pytest.mark.usefixtures("_quiet")
@pytest.mark.parametrize("every", [1, 10])
def test_packed_grpo_with_generation_passes_the_guard(tmp_path: Path, every: int) -> None:
    """Issue 34: TRL generates 16 tokens per completion with ``model.generate`` (training mode, no gradient); the
    guard used to count each decode step as an unpacked training call and raise ``UncheckedError`` before the
    first packed log-probability call. Now only the packed calls count, and the first is checked."""
    trainer, callback = _grpo(tmp_path, every)
    guard = callback.guard
    assert trainer.state.log_history[0]["completions/mean_length"] == 16
    assert guard.unpacked_calls == 0 and guard.calls >= 2     # the old policy's scoring (no gradient), the loss's
    assert guard.records and all(record.ok for record in guard.records)
    assert len(guard.records) == len(range(0, guard.calls, every))


@pytest.mark.usefixtures("_quiet")
def test_trl_grpo_with_generation_is_still_reported(tmp_path: Path) -> None:
    """TRL's own GRPOTrainer pads its scoring: with generation left out, the guard still says it checks nothing."""
    with pytest.raises(UncheckedError, match=r"none of them a packed row.*attention_mask"):
        _grpo(tmp_path, every=1, packed=False)
