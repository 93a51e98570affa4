"""PackedDPOTrainer against trl.DPOTrainer (docs/api.md §7c): one step on the same preference pairs, the
policy and reference forwards on packed rows, gives TRL's padded step: per-sequence log-probability sums,
loss, rewards and margins, updated parameters (fp32 1e-5; one SGD step, so the update is the gradient: Adam's
first step, ``lr * sign(grad)``, turns rounding in near-zero gradients into whole steps)."""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Iterator

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from hybrid_pack.integrations import trl_dpo  # noqa: E402
from hybrid_pack.integrations.transformers import patch_model  # noqa: E402
from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer  # noqa: E402
from hybrid_pack.integrations.trl_dpo import PackedDPOTrainer  # noqa: E402
from tests.support.torch_path import pure_torch_transformers  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _pairs() -> Dataset:
    words = lambda start, n: " ".join(f"w{3 + (start + 7 * j) % 120}" for j in range(n))  # noqa: E731
    rows = [{"prompt": words(i, 2 + i % 5), "chosen": words(50 + i, 1 + i % 4), "rejected": words(90 + i, 3 + i % 6)}
            for i in range(4)]
    return Dataset.from_list(rows)


def _step(trainer_class: type, family: str, tmp_path, calls: list | None = None, bf16: bool = False) -> tuple:
    model = patch_model(tiny_model(family)).train()
    reference = copy.deepcopy(model)
    args = trl.DPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, learning_rate=1e-2,
                         report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, logging_steps=1,
                         beta=0.5, bf16=bf16, optim="sgd")   # Adam's first step is lr * sign(grad)
    trainer = trainer_class(model=model, ref_model=reference, args=args, train_dataset=_pairs(),
                            processing_class=tiny_tokenizer())
    if calls is not None:
        for module in (trainer.model, trainer.ref_model):
            module.register_forward_pre_hook(lambda m, a, k: calls.append(list(k["input_ids"].shape)),
                                             with_kwargs=True)
    with pure_torch_transformers(model), pure_torch_transformers(reference):
        trainer.train()
    log = next(entry for entry in trainer.state.log_history if "loss" in entry)
    return log, {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_packed_dpo_step_equals_trl(family: str, tmp_path, monkeypatch) -> None:
    """fp32 (DPOConfig's default is bf16 autocast, whose rounding differs between any two layouts). The rows'
    lengths come with the batch from the collator: no call reads the device mask."""
    calls: list = []
    readers: list = []
    read = trl_dpo._right_padded_lengths
    monkeypatch.setattr(trl_dpo, "_right_padded_lengths",
                        lambda mask: readers.append(sys._getframe(1).f_code.co_name) or read(mask))
    packed_log, packed_params = _step(PackedDPOTrainer, family, tmp_path / "packed", calls)
    assert readers and set(readers) == {"__call__"}, f"lengths read by {readers}: only the collator may read them"
    padded_log, padded_params = _step(trl.DPOTrainer, family, tmp_path / "padded")
    assert calls and all(shape[0] == 1 for shape in calls), calls       # every forward a packed row [1, R]
    assert padded_log["grad_norm"] > 0.1                                 # a real update is compared
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"):
        assert packed_log[key] == pytest.approx(padded_log[key], abs=1e-5), key
    for name, value in padded_params.items():
        torch.testing.assert_close(packed_params[name], value, rtol=1e-5, atol=1e-5, msg=name)


def test_packed_dpo_trains_with_trl_defaults(tmp_path) -> None:
    """DPOConfig's defaults (bf16 autocast on this CPU): the same step within bf16's precision."""
    packed_log, _ = _step(PackedDPOTrainer, "bamba", tmp_path / "packed", bf16=True)
    padded_log, _ = _step(trl.DPOTrainer, "bamba", tmp_path / "padded", bf16=True)
    for key in ("loss", "logps/chosen", "logps/rejected"):
        assert packed_log[key] == pytest.approx(padded_log[key], rel=2e-2), key


def test_packed_dpo_refuses_neftune(tmp_path) -> None:
    from hybrid_pack.errors import InputError

    with pytest.raises(InputError, match="neftune_noise_alpha: PackedDPOTrainer scores packed rows"):
        PackedDPOTrainer(model=tiny_model("bamba"), ref_model=tiny_model("bamba"), train_dataset=_pairs(),
                         processing_class=tiny_tokenizer(),
                         args=trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                            neftune_noise_alpha=5.0))


def test_packed_dpo_refuses_an_untested_trl(tmp_path, monkeypatch) -> None:
    from hybrid_pack.errors import InputError

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(InputError, match=r"trl: PackedDPOTrainer relies on DPOTrainer's fused LM head.*1\.17\.0"):
        PackedDPOTrainer(model=tiny_model("bamba"), train_dataset=_pairs(), processing_class=tiny_tokenizer(),
                         args=trl.DPOConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True))
