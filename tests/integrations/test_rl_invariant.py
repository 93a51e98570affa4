"""A GRPO step in batch-invariant mode (docs/rl.md, "On-policy numerics"): the same loss, bit for bit, whatever the
packing capacity.

Inside :func:`hybrid_pack.batch_invariant`, a sequence in a static row of ``L`` tokens gets the log-probabilities
it gets alone in a row of ``L`` tokens, whatever its row-mates and its offset (the mixers' chunk grids start at each
sequence's first token and their batched products treat every member alike; attention runs each sequence in a
canonical bucket whose shape depends on the sequence alone). ``PackedGRPOTrainer(batch_invariant=True)`` pads
every row to ``L = packing_capacity``, so:

- at one capacity, every packing gives the same bits: the old policy's, the reference model's and the policy's
  log-probabilities and the entropies are ``torch.equal`` whether the eight sequences share rows or each has its own
  (``max_documents`` None, 3, 1: 3, 6 and 12 forwards of ``[1, 128]``). In particular the policy's log-probabilities in
  the loss (a micro-batch of four sequences) equal the old policy's (all eight, packed otherwise): the importance
  ratio is exactly 1 and the KL to the reference exactly 0, as on-policy training means them;
- across capacities (64, 96, 128) the row length changes; a sequence's chunks and attention bucket do not, and the
  batched products' members and the token-wise GEMMs' rows are stable across batch sizes and row lengths on this
  CPU, so the log-probabilities, the entropies and the loss are bitwise the same at 64, 96 and 128 too (asserted: a
  CPU or BLAS whose GEMM rows depend on the row count would break only this part, not the one-length guarantee).

Outside the mode, the policy's log-probabilities in the loss need not match the old policy's (another packing), so
the ratio can leave 1 by a few ULPs; the figures are printed. The completions are 1 to 57 tokens, longer than the
tiny models' chunk size, so the SSD / GDN chunk grids and the attention reductions do depend on the packing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install 'hybrid_pack[trl]')")

from datasets import Dataset  # noqa: E402

from hybrid_pack.errors import InputError  # noqa: E402
from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer  # noqa: E402
from hybrid_pack.integrations.trl import PackedGRPOTrainer  # noqa: E402
from tests.integrations.test_trl_grpo import (  # noqa: E402, F401  (_quiet: the autouse fixture silencing TRL)
    PROMPTS,
    _config,
    _forwards,
    _quiet,
    _Recorded,
    _reward,
    _saved_model,
)
from tests.support.torch_path import pure_torch_transformers  # noqa: E402

EOS = 1
LENGTHS = (37, 5, 57, 1, 23, 41, 2, 16)      # completion lengths (EOS included): prompt + completion <= 62 tokens
COMPLETIONS = [[3 + (7 * i + j) % 120 for j in range(n - 1)] + [EOS] for i, n in enumerate(LENGTHS)]


def _rollouts(prompts: list[str], trainer: Any) -> dict[str, Any]:
    tokenizer = trainer.processing_class
    return {"prompt_ids": [tokenizer(p)["input_ids"] for p in prompts],
            "completion_ids": [COMPLETIONS[i % len(COMPLETIONS)] for i in range(len(prompts))], "logprobs": None}


def _step(family: str, tmp_path: Path, capacity: int, *, batch_invariant: bool = True,
          max_documents: int | None = None) -> tuple[_Recorded, list[dict[str, Any]]]:
    model = _saved_model(family, tmp_path / "model")
    trainer = PackedGRPOTrainer(model=model, reward_funcs=_reward,
                                args=_config(tmp_path / "out", max_completion_length=64),
                                train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
                                processing_class=tiny_tokenizer(), rollout_func=_rollouts,
                                packing_capacity=capacity, batch_invariant=batch_invariant,
                                max_documents=max_documents)
    recorded = _Recorded(trainer)
    policy, reference = _forwards(trainer.model), _forwards(trainer.ref_model)
    with pure_torch_transformers(model):
        trainer.train()
    assert policy and reference
    return recorded, policy + reference


def _on_policy(recorded: _Recorded) -> tuple[bool, float]:
    """Whether the policy's log-probabilities in the loss (a micro-batch: four of the eight sequences, which TRL
    shuffles) and the reference's equal the old policy's bit for bit (ratio exactly 1, KL exactly 0), and the
    largest difference (each of the policy's sequences against the old policy's row of the same sequence)."""
    (old, _, _), (ref, _, _), (policy, _, _) = recorded.logps
    diffs = [(ref - old).abs().max().item()]
    for row in policy:
        same = (old != 0) == (row != 0)           # the sequence's completion mask (the completions differ in length)
        diffs.append(min((o - row).abs().max().item() for o, m in zip(old, same, strict=True) if m.all()))
    return max(diffs) == 0 and torch.equal(ref, old), max(diffs)


def _equal(a: _Recorded, b: _Recorded) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for p, q in zip(a.logps, b.logps, strict=True)
               for x, y in zip(p, q, strict=True))


@pytest.mark.parametrize("family", ["bamba", "qwen3_5"])
def test_grpo_step_is_bitwise_the_same_whatever_the_packing(family: str, tmp_path: Path) -> None:
    base, forwards = _step(family, tmp_path, 128)
    assert base.logps[-1][1] is not None                         # the policy's entropies are compared too
    assert all(f["shape"] == (1, 128) for f in forwards)         # every forward a static row of the capacity
    on_policy, _ = _on_policy(base)
    assert on_policy                                              # ratio exactly 1, KL exactly 0

    # one row length, other packings: every log-probability and entropy, and the loss, bit for bit
    counts = {len(forwards)}
    for max_documents in (3, 1):
        other, other_forwards = _step(family, tmp_path, 128, max_documents=max_documents)
        counts.add(len(other_forwards))
        assert _equal(base, other), max_documents
        assert torch.equal(other.losses[0], base.losses[0]), max_documents
    assert len(counts) == 3                                       # the packings did differ

    # other capacities (other row lengths): the log-probabilities, the entropies and the loss, bit for bit
    for capacity in (64, 96):
        other, other_forwards = _step(family, tmp_path, capacity)
        assert all(f["shape"] == (1, capacity) for f in other_forwards)
        assert _on_policy(other)[0], capacity
        assert _equal(base, other), capacity
        assert torch.equal(other.losses[0], base.losses[0]), capacity

    # outside the mode (reported): does the loss's forward reproduce the old policy's bits?
    default, _ = _step(family, tmp_path, 128, batch_invariant=False)
    on_policy, diff = _on_policy(default)
    print(f"{family}: outside the mode, capacity 128: policy/reference == old policy bitwise: {on_policy} "
          f"(max |dlogp| {diff:.3g}); loss {default.losses[0].item()!r} against {base.losses[0].item()!r} in the mode")


def test_batch_invariant_refuses_what_it_cannot_honour(tmp_path: Path) -> None:
    def make(**kwargs: Any) -> Any:
        settings = {key: kwargs.pop(key) for key in list(kwargs) if key in ("torch_compile",)}
        return PackedGRPOTrainer(model=tiny_model("bamba"), reward_funcs=_reward,
                                 args=_config(tmp_path, beta=0.0, **settings),
                                 processing_class=tiny_tokenizer(),
                                 train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), **kwargs)

    with pytest.raises(InputError, match="batch_invariant: PackedGRPOTrainer needs a fixed row length.*"
                                         "packing_capacity"):
        make(batch_invariant=True)
    with pytest.raises(InputError, match="batch_invariant: not with torch_compile"):
        make(batch_invariant=True, packing_capacity=64, torch_compile=True)
    with pytest.raises(InputError, match="batch_invariant: expected True or False"):
        make(batch_invariant="yes", packing_capacity=64)
    with pytest.raises(InputError, match="max_documents: expected an int >= 1"):
        make(max_documents=0, packing_capacity=64)


def test_the_mode_switches_the_reference_models_experts_too(tmp_path: Path) -> None:
    """A MoE family: batch_invariant=True puts the policy's and the reference model's experts on ``batched_mm``
    (GRPO loads its reference, DPO is handed one); DPO refuses a router auxiliary loss naming the option that turns
    it off, before it changes either model."""
    import copy

    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.trl import PackedDPOTrainer
    from tests.integrations.test_trl_dpo import _pairs

    grpo = PackedGRPOTrainer(model=_saved_model("qwen3_next", tmp_path / "model"), reward_funcs=_reward,
                             args=_config(tmp_path / "grpo"), processing_class=tiny_tokenizer(),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}), packing_capacity=128,
                             batch_invariant=True)
    reference = grpo.accelerator.unwrap_model(grpo.ref_model)
    assert grpo.model.config._experts_implementation == reference.config._experts_implementation == "batched_mm"

    def dpo(model: Any, reference: Any, **config: Any) -> Any:
        args = trl.DPOConfig(output_dir=str(tmp_path / "dpo"), per_device_train_batch_size=4, max_steps=1,
                             report_to=[], use_cpu=True, save_strategy="no", bf16=False, **config)
        return PackedDPOTrainer(model=model, ref_model=reference, args=args, train_dataset=_pairs(),
                                processing_class=tiny_tokenizer(), packing_capacity=128, batch_invariant=True)

    model = patch_model(tiny_model("qwen3_next")).train()
    reference = copy.deepcopy(model)
    before = model.config._experts_implementation
    with pytest.raises(InputError, match=r"router_aux_loss_coef=0\.0"):
        dpo(model, reference)
    assert before != "batched_mm"
    assert model.config._experts_implementation == reference.config._experts_implementation == before
    trainer = dpo(model, reference, router_aux_loss_coef=0.0)
    assert trainer.model.config._experts_implementation == "batched_mm"
    assert trainer.ref_model.config._experts_implementation == "batched_mm"


def test_dpo_in_the_mode_runs_static_rows_and_matches_the_default_step(tmp_path: Path) -> None:
    """PackedDPOTrainer(batch_invariant=True): every forward of the policy and the reference a static row of
    ``packing_capacity`` tokens, and the step TRL logs equal to the default packed step's (fp32, 1e-5)."""
    import copy

    from hybrid_pack.integrations.transformers import patch_model
    from hybrid_pack.integrations.trl import PackedDPOTrainer
    from tests.integrations.test_trl_dpo import _pairs

    def step(out: Path, **options: Any) -> tuple[dict[str, float], list[list[int]]]:
        model = patch_model(tiny_model("bamba")).train()
        reference = copy.deepcopy(model)
        args = trl.DPOConfig(output_dir=str(out), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-2,
                             report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1,
                             beta=0.5, bf16=False, optim="sgd")
        trainer = PackedDPOTrainer(model=model, ref_model=reference, args=args, train_dataset=_pairs(),
                                   processing_class=tiny_tokenizer(), **options)
        shapes: list[list[int]] = []
        for module in (trainer.model, trainer.ref_model):
            module.register_forward_pre_hook(lambda m, a, k: shapes.append(list(k["input_ids"].shape)),
                                             with_kwargs=True)
        with pure_torch_transformers(model), pure_torch_transformers(reference):
            trainer.train()
        return next(entry for entry in trainer.state.log_history if "loss" in entry), shapes

    invariant, shapes = step(tmp_path / "mode", batch_invariant=True, packing_capacity=128)
    default, _ = step(tmp_path / "default")
    assert shapes and all(shape == [1, 128] for shape in shapes), shapes
    for key in ("loss", "logps/chosen", "logps/rejected", "rewards/margins"):
        assert invariant[key] == pytest.approx(default[key], abs=1e-5), key
    with pytest.raises(InputError, match="packing_capacity: PackedDPOTrainer packs each call into one row"):
        step(tmp_path / "bad", packing_capacity=128)


def test_the_guard_certifies_the_mode_every_n_calls(tmp_path: Path) -> None:
    """``PackingGuardCallback(invariance_every=2)``: every second packed log-probability call certified with
    ``check_invariance`` on its own documents; inside the mode every report is bitwise invariant."""
    from hybrid_pack.integrations.transformers.guard import PackingGuardCallback
    from hybrid_pack.testing import InvarianceReport

    callback = PackingGuardCallback(every=100, invariance_every=2)
    model = _saved_model("bamba", tmp_path / "model")
    trainer = PackedGRPOTrainer(model=model, reward_funcs=_reward,
                                args=_config(tmp_path / "out", beta=0.0, max_completion_length=64),
                                train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
                                processing_class=tiny_tokenizer(), rollout_func=_rollouts, callbacks=[callback],
                                packing_capacity=128, batch_invariant=True)
    with pure_torch_transformers(model):
        trainer.train()
    guard = callback.guard
    assert guard.calls >= 3 and len(guard.invariance) == (guard.calls + 1) // 2
    for _, report in guard.invariance:
        assert isinstance(report, InvarianceReport) and report.ok and report.row_length == 128, report
    with pytest.raises(InputError, match="invariance_every: expected an int >= 1"):
        PackingGuardCallback(invariance_every=0)


def test_packed_trainer_in_the_mode_trains_on_static_rows_inside_it(tmp_path: Path) -> None:
    """PackedTrainer(batch_invariant=True): the default collator is static (rows of ``capacity`` tokens), every
    training forward runs inside the mode, and a collator of another row length or torch_compile is refused."""
    from transformers import TrainingArguments

    from hybrid_pack import PackingCollator
    from hybrid_pack.integrations.transformers.trainer import PackedTrainer
    from hybrid_pack.modeling import from_preset
    from hybrid_pack.ops.invariant import is_batch_invariant
    from hybrid_pack.schema import INPUT_IDS
    from hybrid_pack.training.data import build_features, load_chats

    model = from_preset("bamba-tiny", vocab_size=512)
    features, _ = build_features(load_chats("gsm8k", 8), model.config.vocab_size, max_length=256)
    lengths = [len(f[INPUT_IDS]) for f in features]

    def make(**kwargs: Any) -> Any:
        args = TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=1, report_to=[],
                                 use_cpu=True, save_strategy="no", disable_tqdm=True,
                                 torch_compile=kwargs.pop("torch_compile", False))
        return PackedTrainer(model=model, args=args, train_dataset=features, lengths=lengths, capacity=256,
                             batch_invariant=True, **kwargs)

    trainer = make()
    seen: list[tuple[tuple[int, ...], bool]] = []
    handle = model.register_forward_pre_hook(
        lambda m, a, k: seen.append((tuple(k[INPUT_IDS].shape), is_batch_invariant())), with_kwargs=True)
    trainer.train()
    handle.remove()
    assert seen and all(entry == ((1, 256), True) for entry in seen), seen
    with pytest.raises(InputError, match="batch_invariant: the collator's rows must all be 256 tokens"):
        make(collator=PackingCollator())
    with pytest.raises(InputError, match="batch_invariant: not with torch_compile"):
        make(torch_compile=True)
