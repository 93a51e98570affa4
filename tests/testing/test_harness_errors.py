"""The harness never turns an error into a verdict (docs/api.md §7c): a check that raises is reported as
ERROR (never LEAK, never ok), and a trainer it cannot drive is refused, naming it and what is supported."""

from __future__ import annotations

import warnings

import pytest
import torch

from hybrid_pack import PackingCollator
from hybrid_pack.errors import InputError
from hybrid_pack.modeling import from_preset
from hybrid_pack.schema import INPUT_IDS
from hybrid_pack.testing import check_isolation, check_training_step


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    return PackingCollator()([{INPUT_IDS: torch.randint(1, 500, (n,), generator=g)} for n in (5, 9, 3)])


def test_a_step_that_raises_is_an_error_not_a_leak() -> None:
    model = from_preset("qwen3-next-tiny", vocab_size=512)

    def step(batch: dict) -> torch.Tensor:
        raise TypeError("compute_loss() got an unexpected keyword argument 'seq_idx'")

    report = check_training_step(step, _batch(), model=model)
    assert not report.ok and report.error.startswith("TypeError")
    text = str(report)
    assert text.startswith("ERROR") and "LEAK" not in text and "ISOLATED" not in text
    assert "unexpected keyword argument 'seq_idx'" in text


def test_a_trl_rl_trainer_is_refused_by_name(tmp_path) -> None:
    """GRPO's compute_loss takes prompts and completions, not a packed row."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from hybrid_pack.integrations.transformers.tiny import tiny_model, tiny_tokenizer

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                          max_completion_length=4, report_to=[], use_cpu=True, save_strategy="no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.GRPOTrainer(model=tiny_model("bamba"), reward_funcs=lambda completions, **_: [0.0] * len(
            completions), args=args, train_dataset=Dataset.from_list([{"prompt": "w3 w4 w5"}] * 4),
            processing_class=tiny_tokenizer())
    for check in (check_isolation, check_training_step):
        with pytest.raises(InputError, match=r"GRPOTrainer: its compute_loss \(trl\..*Supported: .*SFTTrainer"):
            check(trainer)
