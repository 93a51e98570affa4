"""tokenize_and_plan: Dataset.map tokenization, the lengths column and the plan agree."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_pack import plan_packs
from hybrid_pack.errors import InputError
from hybrid_pack.packing.hf_datasets import tokenize_and_plan

datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

WORDS = ["alpha", "beta", "gamma", "delta", "eps"]


def _texts(num: int) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, rng.integers(1, 40))) for _ in range(num)]


def _word_level() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="eps"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tokenizer


class CallableTokenizer:
    """Stands in for a transformers tokenizer: called on a batch, returns a mapping with input_ids."""

    def __call__(self, texts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [[WORDS.index(w) for w in text.split()] for text in texts]}


@pytest.mark.parametrize("tokenizer", [_word_level(), CallableTokenizer()], ids=["tokenizers", "callable"])
def test_lengths_columns_and_plan(tmp_path, tokenizer):
    texts = _texts(300)
    dataset = datasets.Dataset.from_dict({"text": texts, "id": list(range(300))})
    result = tokenize_and_plan(dataset, tokenizer, 64, batch_size=50, cache_file_name=str(tmp_path / "tok.arrow"))
    expected = [[WORDS.index(w) for w in text.split()] for text in texts]
    assert result.dataset.column_names == ["id", "input_ids", "length"]
    assert result.dataset["input_ids"][:] == expected
    np.testing.assert_array_equal(result.lengths, [len(ids) for ids in expected])
    reference = plan_packs(result.lengths, 64)
    np.testing.assert_array_equal(result.plan.example_index, reference.example_index)
    np.testing.assert_array_equal(result.plan.pack_offsets, reference.pack_offsets)


def test_errors_name_the_column(tmp_path):
    dataset = datasets.Dataset.from_dict({"text": ["alpha", ""]})
    with pytest.raises(InputError, match="text_column"):
        tokenize_and_plan(dataset, CallableTokenizer(), 8, text_column="body")
    with pytest.raises(InputError, match=r"text\[1\]"):
        tokenize_and_plan(dataset, CallableTokenizer(), 8, cache_file_name=str(tmp_path / "e.arrow"))


def test_settings_are_checked_before_the_tokenization_pass():
    """A typo in capacity cost the whole (long) tokenization pass first; a list of rows raised AttributeError."""
    calls = []

    def tokenizer(texts):
        calls.append(len(texts))
        return [[ord(c) for c in t] for t in texts]

    dataset = datasets.Dataset.from_dict({"text": ["ab", "cde"] * 5})
    for kwargs, field in (({"capacity": 0}, "capacity"), ({"capacity": 8, "strategy": "best"}, "strategy"),
                          ({"capacity": 8, "overflow": "wrap"}, "overflow")):
        with pytest.raises(InputError, match=f"^{field}: expected"):
            tokenize_and_plan(dataset, tokenizer, **kwargs)
    assert calls == []
    with pytest.raises(InputError, match="dataset: expected a datasets.Dataset .* got list"):
        tokenize_and_plan([{"text": "ab"}], tokenizer, 8)
