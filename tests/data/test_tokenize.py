"""tokenize_chats: only assistant turns are trained, prompts and responses match the length tables, and
the features collate."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from hybrid_pack import PackingCollator
from hybrid_pack.data import format_chat, load_lengths, tokenize_chats
from tests.data.chats import ENDOFTEXT, IM_END, IM_START, TEMPLATE_CASES, TEMPLATE_TOOLS


def test_only_assistant_turns_are_trained(tokenizer: Tokenizer, toolcall_chats) -> None:
    chats = [{"messages": TEMPLATE_CASES["tool calls and responses"], "tools": TEMPLATE_TOOLS},
             {"messages": TEMPLATE_CASES["system and multi turn"]}, *toolcall_chats[:40]]
    for chat, feature in zip(chats, tokenize_chats(chats)):
        rendered = format_chat(chat)
        ids, labels = np.array(feature["input_ids"]), np.array(feature["labels"])
        trained = labels != -100
        assert np.array_equal(labels[trained], ids[trained])
        trained_text = tokenizer.decode(ids[trained].tolist(), skip_special_tokens=False)
        assert trained_text == "".join(rendered.text[a:b] for a, b in rendered.assistant_spans)
        # <|im_end|> is trained where it closes an assistant turn, and only there.
        ends = np.flatnonzero(ids == IM_END)
        turn_roles = [tokenizer.decode([ids[np.flatnonzero(ids[:end] == IM_START)[-1] + 1]]) for end in ends]
        assert [bool(trained[end]) for end in ends] == [role == "assistant" for role in turn_roles]
        assert not trained[ids == IM_START].any() and not trained[-1]  # the final "\n" is prompt


def test_gsm8k_prompt_and_response_match_the_length_table(gsm8k_train) -> None:
    table = load_lengths("gsm8k_train")
    for i, feature in enumerate(tokenize_chats(gsm8k_train[:200], empty_think=False)):
        labels = np.array(feature["labels"])
        trained = np.flatnonzero(labels != -100)
        # The table counts "<|im_end|>\n" in the response; the newline after <|im_end|> is not trained.
        assert trained[0] == table["last_turn_prompt"][i]
        assert len(trained) == table["last_turn_response"][i] - 1
        assert trained[-1] == len(labels) - 2 and labels[trained[-1]] == IM_END


def test_max_length_keeps_the_start(gsm8k_train) -> None:
    full = tokenize_chats(gsm8k_train[:3])
    cut = tokenize_chats(gsm8k_train[:3], max_length=50)
    for a, b in zip(full, cut):
        assert b["input_ids"] == a["input_ids"][:50] and b["labels"] == a["labels"][:50]


def test_tokenize_chats_rejects_bad_arguments(gsm8k_train) -> None:
    with pytest.raises(ValueError, match=r"max_length: expected a positive int"):
        tokenize_chats(gsm8k_train[:1], max_length=0)
    padded = Tokenizer(WordLevel({"<pad>": 0}, unk_token="<pad>"))
    padded.enable_padding(length=8)
    with pytest.raises(ValueError, match=r"tokenizer: expected padding and truncation off"):
        tokenize_chats(gsm8k_train[:1], padded)


def test_collating_tokenized_chats(gsm8k_train) -> None:
    features = tokenize_chats(gsm8k_train[:8])
    batch = PackingCollator(pad_to_multiple_of=128, pad_token_id=ENDOFTEXT)(features)
    starts = batch["cu_seq_lens_q"][:-1].tolist()
    assert batch["input_ids"][0, starts[:-1]].tolist() == [IM_START] * 8
    assert (batch["labels"][0, starts] == -100).all()
    assert int((batch["labels"] != -100).sum()) == sum(sum(label != -100 for label in f["labels"]) for f in features)
