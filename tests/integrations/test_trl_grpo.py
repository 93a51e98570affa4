"""PackedGRPOTrainer: one step equals ``trl.GRPOTrainer``'s on the same generations.

Generation is made deterministic with TRL's ``rollout_func`` (fixed completions of different lengths: one
that is only an EOS, truncated ones that ``mask_truncated_completions`` masks entirely, an ``env_mask`` that
becomes TRL's ``tool_mask``), so both trainers see the same batch. The reference is TRL's own trainer on the
unpatched model (transformers' torch code for the mixers, fla's kernels bypassed on CPU); the packed trainer
must give the same per-token log-probabilities of the old policy, the reference model and the policy, the
entropies, the MoE auxiliary loss, the loss and the parameters after one SGD step, with every model forward
of its log-probability method a packed row ``[1, T]`` with boundary keys.
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

from hybrid_pack.errors import InputError  # noqa: E402
from hybrid_pack.integrations import trl_grpo  # noqa: E402
from hybrid_pack.integrations.transformers import is_patched  # noqa: E402
from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer  # noqa: E402
from hybrid_pack.integrations.trl import TESTED_TRL, PackedGRPOTrainer  # noqa: E402
from hybrid_pack.integrations.trl_grpo import _real_lengths as real_lengths  # noqa: E402
from hybrid_pack.schema import ATTENTION_MASK, CU_SEQ_LENS_Q, INPUT_IDS, SEQ_IDX  # noqa: E402
from tests.support.torch_path import pure_torch_transformers  # noqa: E402

EOS = 1
PROMPTS = ["w3 w4 w5 w6 w7", "w9 w10"]                 # 5 and 2 tokens: left padding in TRL's batch
COMPLETIONS = [                                         # by position in the generation batch
    [5, 6, 7, EOS],
    [8, 9, 10, 11, 12, 13, 14],                         # truncated (no EOS)
    [EOS],                                              # only an EOS
    [16, 17, 18, 19, 20, 21, 22, 23, EOS],
    [30, 31, 32],                                       # truncated
    [40, EOS],
    [41, 42, 43, 44, 45, EOS],
    [50],                                               # truncated, one token
]
LEARNING_RATE = 0.1


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def _rollouts(prompts: list[str], trainer: Any) -> dict[str, Any]:
    """Fixed completions (by position), an env_mask (TRL's tool_mask: 0 on tokens 2 and 3 of each completion)."""
    tokenizer = trainer.processing_class
    completions = [COMPLETIONS[i % len(COMPLETIONS)] for i in range(len(prompts))]
    return {"prompt_ids": [tokenizer(p)[INPUT_IDS] for p in prompts], "completion_ids": completions,
            "logprobs": None, "env_mask": [[0 if j in (2, 3) else 1 for j in range(len(c))] for c in completions]}


def _reward(completions: list[str], **_: Any) -> list[float]:
    return [float(len(c)) for c in completions]


def _config(out: Path, **overrides: Any) -> Any:
    """Eight generations (two prompts, four each) in chunks of four: the old policy's and the reference model's
    log-probabilities run in two chunks, the loss on the first four; beta > 0 loads a reference model."""
    settings = {"output_dir": str(out), "per_device_train_batch_size": 4, "steps_per_generation": 2,
                "num_generations": 4, "max_steps": 1, "learning_rate": LEARNING_RATE, "optim": "sgd",
                "beta": 0.1, "use_cpu": True, "bf16": False, "report_to": [], "save_strategy": "no",
                "disable_tqdm": True, "logging_steps": 1, "seed": 0}
    return trl.GRPOConfig(**{**settings, **overrides})


def _saved_model(family: str, path: Path) -> torch.nn.Module:
    """A tiny model whose config names a saved copy (TRL loads the reference model from there)."""
    if not (path / "config.json").exists():
        tiny_model(family).save_pretrained(path)
    model = tiny_model(family).train()
    model.config._name_or_path = str(path)
    return model


class _Recorded:
    """Every result of the trainer's log-probability method and every loss, detached."""

    def __init__(self, trainer: Any) -> None:
        self.logps: list[tuple[torch.Tensor | None, ...]] = []
        self.losses: list[torch.Tensor] = []
        logps_method, loss_method = trainer._get_per_token_logps_and_entropies, trainer.compute_loss

        def logps(*args: Any, **kwargs: Any) -> Any:
            out = logps_method(*args, **kwargs)
            self.logps.append(tuple(None if x is None else x.detach().clone() for x in out))
            return out

        def loss(*args: Any, **kwargs: Any) -> Any:
            out = loss_method(*args, **kwargs)
            self.losses.append(out.detach().clone())
            return out

        trainer._get_per_token_logps_and_entropies, trainer.compute_loss = logps, loss


def _forwards(model: torch.nn.Module) -> list[dict[str, Any]]:
    """What every forward of ``model`` receives (a pre-hook ahead of the patch's own)."""
    calls: list[dict[str, Any]] = []

    def hook(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append({"args": len(args), "shape": tuple(kwargs[INPUT_IDS].shape),
                      "keys": {key for key, value in kwargs.items() if value is not None}})

    model.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    return calls


def _train(trainer_class: type, family: str, tmp_path: Path, capacity: int | None = None, peft_config: Any = None,
           **overrides: Any) -> tuple[Any, _Recorded, list[dict[str, Any]]]:
    """One step of ``trainer_class``; what its log-probability method returned, its loss, and what every forward
    of the policy and the reference model received."""
    model = _saved_model(family, tmp_path / "model")
    extra = {} if trainer_class is trl.GRPOTrainer else {"packing_capacity": capacity}
    trainer = trainer_class(model=model, reward_funcs=_reward, args=_config(tmp_path / "out", **overrides),
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
                            processing_class=tiny_tokenizer(), rollout_func=_rollouts, peft_config=peft_config,
                            **extra)
    recorded = _Recorded(trainer)
    policy_forwards = _forwards(trainer.model)
    ref_forwards = [] if trainer.ref_model is None else _forwards(trainer.ref_model)
    with pure_torch_transformers(model):
        trainer.train()
    return trainer, recorded, policy_forwards + ref_forwards


@pytest.mark.parametrize(("capacity", "settings"), [(None, {"mask_truncated_completions": True}),
                                                     (16, {"mask_truncated_completions": False, "temperature": 0.7})],
                         ids=["one-row-per-chunk", "capacity-16"])
@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_one_step_equals_trl(family: str, capacity: int | None, settings: dict[str, Any], tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Same generations, one SGD step: TRL's padded trainer against the packed one (one row per chunk, or rows
    of at most 16 tokens), with and without ``mask_truncated_completions``, at TRL's default temperature and
    another (the fused LM head divides the logits by it). The packed trainer forms every row from the lengths
    taken on the host from the generated token lists: it never reads the masks."""
    reference, expected, _ = _train(trl.GRPOTrainer, family, tmp_path, **settings)
    mask_reads: list[int] = []
    monkeypatch.setattr(trl_grpo, "_real_lengths", lambda *args: mask_reads.append(1) or real_lengths(*args))
    packed, got, forwards = _train(PackedGRPOTrainer, family, tmp_path, capacity, **settings)
    assert mask_reads == [], "a log-probability call read the attention mask"
    assert is_patched(packed.model) and is_patched(packed.ref_model) and not is_patched(reference.model)

    # old policy (2 chunks), reference model (2 chunks), policy in the loss: logps, entropies, MoE aux loss
    assert len(got.logps) == len(expected.logps) == 3
    for (want_logps, want_entropy, want_aux), (logps, entropy, aux) in zip(expected.logps, got.logps, strict=True):
        assert logps.shape == want_logps.shape and logps.dtype == torch.float32
        torch.testing.assert_close(logps, want_logps, rtol=0, atol=1e-5)
        assert torch.equal(logps == 0, want_logps == 0)          # zero exactly where TRL's are
        assert (entropy is None) == (want_entropy is None) and (aux is None) == (want_aux is None)
        if entropy is not None:
            torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
        if aux is not None:
            torch.testing.assert_close(aux, want_aux, rtol=0, atol=1e-5)
    policy_logps = expected.logps[-1][0]
    assert (policy_logps == 0).any() and (policy_logps != 0).any()
    assert (expected.logps[-1][2] is not None) == (family == "qwen3_next")   # Qwen3-Next is a MoE

    assert len(got.losses) == len(expected.losses) == 1
    torch.testing.assert_close(got.losses[0], expected.losses[0], rtol=0, atol=1e-5)
    for (name, want), (_, param) in zip(reference.model.named_parameters(), packed.model.named_parameters(),
                                        strict=True):
        torch.testing.assert_close(param, want, rtol=0, atol=1e-5, msg=name)
    moved = max((p - q).abs().max().item() for p, q in zip(reference.model.parameters(),
                                                             tiny_model(family).parameters(), strict=True))
    assert moved > 1e-3                                                  # the step did change the model

    # every forward of the policy and the reference model: one packed row with boundary keys, no mask
    assert all(f["shape"][0] == 1 and {CU_SEQ_LENS_Q, SEQ_IDX} <= f["keys"] and ATTENTION_MASK not in f["keys"]
               for f in forwards), forwards
    if capacity is None:
        assert len(forwards) == 5                        # one row per chunk: 2 (old) + 2 (reference) + 1 (loss)
    else:
        assert len(forwards) > 5 and max(f["shape"][1] for f in forwards) <= capacity


def test_lora_step_equals_trl(tmp_path: Path) -> None:
    """LoRA: TRL takes the reference log-probabilities from the policy with its adapter disabled."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["in_proj_qkvz", "q_proj", "v_proj"])
    reference, expected, _ = _train(trl.GRPOTrainer, "qwen3_next", tmp_path, peft_config=lora)
    packed, got, forwards = _train(PackedGRPOTrainer, "qwen3_next", tmp_path, peft_config=lora)
    assert isinstance(packed.model, peft.PeftModel) and packed.ref_model is None and is_patched(packed.model)
    assert len(got.logps) == len(expected.logps) == 3
    for want, logps in zip(expected.logps, got.logps, strict=True):
        torch.testing.assert_close(logps[0], want[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.losses[0], expected.losses[0], rtol=0, atol=1e-5)
    for want, param in zip(reference.model.parameters(), packed.model.parameters(), strict=True):
        torch.testing.assert_close(param, want, rtol=0, atol=1e-5)
    assert len(forwards) == 5 and all(f["shape"][0] == 1 and CU_SEQ_LENS_Q in f["keys"] for f in forwards)


def test_refuses_an_untested_trl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(InputError, match=r"trl: PackedGRPOTrainer relies on GRPOTrainer\._get_per_token_logps_and"
                                         r"_entropies.*found trl 1\.17\.0"):
        PackedGRPOTrainer(model=tiny_model("bamba"), reward_funcs=_reward, args=_config(tmp_path))
    assert TESTED_TRL == ((1, 16), (1, 17))


@pytest.mark.parametrize("capacity", [0, 2.5, True])
def test_refuses_a_bad_capacity(capacity: Any, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="packing_capacity: expected an int >= 1"):
        PackedGRPOTrainer(model=tiny_model("bamba"), reward_funcs=_reward, args=_config(tmp_path),
                          packing_capacity=capacity)


def test_refuses_neftune(tmp_path: Path) -> None:
    """transformers' NEFTune would scale each completion's noise by the packed row's length, silently weaker."""
    with pytest.raises(InputError, match="neftune_noise_alpha: PackedGRPOTrainer scores packed rows"):
        PackedGRPOTrainer(model=tiny_model("bamba"), reward_funcs=_reward, processing_class=tiny_tokenizer(),
                          args=_config(tmp_path, beta=0.0, neftune_noise_alpha=5.0),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}))


def test_refuses_multimodal_inputs_and_overlong_sequences(tmp_path: Path) -> None:
    trainer = PackedGRPOTrainer(model=tiny_model("bamba"), reward_funcs=_reward, args=_config(tmp_path, beta=0.0),
                                train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
                                processing_class=tiny_tokenizer(), packing_capacity=4)
    ids, mask = torch.tensor([[0, 3, 4, 5, 6, 1]]), torch.tensor([[0, 1, 1, 1, 1, 1]])
    with pytest.raises(InputError, match="pixel_values: PackedGRPOTrainer packs text-only batches"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 2, pixel_values=torch.zeros(1, 3))
    with pytest.raises(InputError, match="packing_capacity: sequence 0 of the micro-batch has 5 real prompt"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 2)


def _guarded(trainer_class: type, family: str, tmp_path: Path, action: str, leak_after: int | None = None) -> Any:
    """One GRPO step with ``PackingGuardCallback(every=1)``; a leak planted in layer 0's mixer if asked."""
    from hybrid_pack.integrations.transformers.guard import PackingGuardCallback
    from tests.testing.late_leak import LeakAfter

    model = _saved_model(family, tmp_path / "model")
    callback = PackingGuardCallback(every=1, action=action)
    trainer = trainer_class(model=model, reward_funcs=_reward, args=_config(tmp_path / "out", beta=0.0),
                            train_dataset=Dataset.from_dict({"prompt": PROMPTS * 4}),
                            processing_class=tiny_tokenizer(), rollout_func=_rollouts, callbacks=[callback])
    if leak_after is not None:
        LeakAfter(model.model.layers[0].linear_attn, after=leak_after)
    with pure_torch_transformers(model):
        trainer.train()
    return callback


def test_the_guard_checks_packed_grpo_and_catches_a_planted_leak(tmp_path: Path) -> None:
    from hybrid_pack.errors import IsolationError

    clean = _guarded(PackedGRPOTrainer, "qwen3_next", tmp_path / "clean", "raise")
    assert clean.guard.records and all(record.ok for record in clean.guard.records)
    with pytest.raises(IsolationError, match="differs from the same document run alone"):
        _guarded(PackedGRPOTrainer, "qwen3_next", tmp_path / "leak", "raise", leak_after=0)


def test_the_guard_on_trl_grpo_says_it_checks_nothing(tmp_path: Path) -> None:
    """TRL's GRPO pads: the guard sees no packed call and says so (it used to stay silent)."""
    from hybrid_pack.errors import UncheckedError
    from hybrid_pack.testing import IsolationWarning

    with pytest.warns(IsolationWarning, match="none of them a packed row"):
        callback = _guarded(trl.GRPOTrainer, "bamba", tmp_path / "warn", "warn")
    assert callback.guard.records == [] and callback.guard.unpacked_calls > 0
    with pytest.raises(UncheckedError, match="none of them a packed row"):
        _guarded(trl.GRPOTrainer, "bamba", tmp_path / "raise", "raise")
