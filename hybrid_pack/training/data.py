"""Training data: chats -> tokenized features with prompt tokens masked, in the model's vocabulary."""

from __future__ import annotations

import json
from typing import Any

from hybrid_pack.data import load_gsm8k, tokenize_chats
from hybrid_pack.errors import InputError
from hybrid_pack.modeling.vocab import VocabRemap
from hybrid_pack.schema import INPUT_IDS

TOKENIZER_VOCAB = 151_669


def load_chats(data: str, max_examples: int | None = None) -> list[dict[str, Any]]:
    """``"gsm8k"`` (bundled train split) or a JSONL file with one ``{"messages": [...]}`` chat per line."""
    if data == "gsm8k":
        chats = load_gsm8k("train")
    else:
        chats = []
        with open(data, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                    raise InputError(f"data: line {number} of {data} has no 'messages' list; expected one "
                                     '{"messages": [{"role": ..., "content": ...}, ...]} object per line')
                chats.append(row)
        if not chats:
            raise InputError(f"data: {data} holds no chats")
    return chats[:max_examples]


def build_features(chats: list[dict[str, Any]], vocab_size: int, *,
                   max_length: int) -> tuple[list[dict], VocabRemap | None]:
    """Tokenize ``chats`` (Qwen3 ChatML, prompts masked) and, for a model with a smaller vocabulary than
    the tokenizer's, remap ids to the ``vocab_size - 1`` most frequent ones (the rest become ``<unk>``).

    Returns:
        ``(features, remap)``: features are ``{"input_ids", "labels"}`` lists of ints; ``remap`` is None when
        the model covers the tokenizer's vocabulary.
    """
    features = tokenize_chats(chats, max_length=max_length)
    features = [f for f in features if len(f[INPUT_IDS]) > 1]
    if vocab_size >= TOKENIZER_VOCAB:
        return features, None
    remap = VocabRemap.from_corpus((f[INPUT_IDS] for f in features), size=vocab_size)
    return [remap.encode_example(f) for f in features], remap

